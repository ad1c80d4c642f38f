// The plain call's plans (functional._PLANS) seen from C: the plan key of
// NumPy arrays, and the whole planned call on NumPy arrays or torch tensors. A decode step
// pays its entry point's fixed cost once per layer per token (issue 38): at
// a few hundred keys the Python reading of three tensors (Tensor.numpy(),
// 0.7 µs each) and of their metadata costs more than the kernel. Torch is
// optional: nothing here links or includes it. Tensors are read through torch's
// DLPack exchange table (a C ABI) where it has one, else through their Python
// attributes, and only exact torch.Tensor objects of the kinds that
// Tensor.numpy() would read (CPU, strided, no grad, no negative bit); anything
// else gives None and takes the checked path, which raises for bad input.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace py = pybind11;

namespace attn_fast {
namespace bindings {

// run(q, k, v, o, scale) when `run` is a _core.BoundDecode (bindings_decode.cpp);
// false, calling nothing, for any other callable.
bool call_bound_decode(py::handle run, py::handle q, py::handle k, py::handle v, py::handle o,
                       py::handle scale);

// DecodeRing::append_step on `ring` (a _core.DecodeRing; bindings_decode.cpp).
py::object ring_append_step(py::handle ring, const py::array& q, const py::array& k,
                            const py::array& v, py::handle scale, int64_t window_left,
                            const py::array& n, const py::array& start, const py::array& pos,
                            const py::array& last_new);

namespace {

namespace npd = py::detail;

constexpr int kMaxNd = 8;
constexpr int kNpyHalf = 23;  // NPY_HALF in NumPy's ABI (pybind11 names no half type)

// A plan key's int64 words: flags, the scale's bits, then per array its
// dtype number and rank, its sizes and its strides in bytes.
struct KeyWords {
  int64_t w[2 + 4 * (1 + 2 * kMaxNd)];
  int n = 0;

  // Returns false (no plan key) for a scale that is neither None nor a float.
  bool header(bool is_causal, bool enable_gqa, bool has_out, PyObject* scale) {
    double s = 0;
    const bool given = scale != Py_None;
    if (given) {
      if (!PyFloat_CheckExact(scale)) return false;
      s = PyFloat_AS_DOUBLE(scale);
    }
    w[n++] =
        int64_t(is_causal) | int64_t(enable_gqa) << 1 | int64_t(has_out) << 2 | int64_t(given) << 3;
    std::memcpy(&w[n++], &s, sizeof s);  // the bits: -0.0 and 0.0 are two plans, both checked
    return true;
  }
  void array(int type_num, int nd, const int64_t* dims, const int64_t* strides) {
    w[n++] = int64_t(type_num) | int64_t(nd) << 16;
    for (int j = 0; j < nd; ++j) w[n++] = dims[j];
    for (int j = 0; j < nd; ++j) w[n++] = strides[j];
  }
  // A 4-D k or v of a one-row decode key: its dtype and sizes without the key count
  // (axis 2) or the strides, which a one-row decode plan does not depend on (lk_free).
  void free_kv(int type_num, const int64_t* dims) {
    w[n++] = int64_t(type_num) | int64_t(4) << 16 | int64_t(1) << 32;
    w[n++] = dims[0], w[n++] = dims[1], w[n++] = dims[3];
  }
  // The key's bytes, after `prefix` (b"t" for tensors: a plan serves one input kind).
  py::object bytes(const char* prefix = "") const {
    const size_t np = std::strlen(prefix), nb = size_t(n) * sizeof(int64_t);
    PyObject* b = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(np + nb));
    if (!b) throw py::error_already_set();
    std::memcpy(PyBytes_AS_STRING(b), prefix, np);
    std::memcpy(PyBytes_AS_STRING(b) + np, w, nb);
    return py::reinterpret_steal<py::object>(b);
  }
};

// One array's words of a plan key; false when `x` is not an exact numpy.ndarray of
// float32 / float64 / float16 (or, with bits16, uint16: bfloat16 bits read from a
// tensor), aligned, in native byte order, of at most 8 dimensions.
// What a plan key reads of one input: dtype number, rank, sizes, strides in bytes.
struct KeyedArray {
  int type_num = 0, nd = 0;
  const int64_t* dims = nullptr;
  const int64_t* strides = nullptr;
};

bool read_array(PyObject* x, bool bits16, KeyedArray& r) {
  const auto& api = npd::npy_api::get();
  if (Py_TYPE(x) != api.PyArray_Type_) return false;  // subclasses: fast_view decides
  const auto* a = npd::array_proxy(x);
  const auto* d = npd::array_descriptor_proxy(a->descr);
  const bool fast = d->type_num == npd::npy_api::NPY_FLOAT_ ||
                    d->type_num == npd::npy_api::NPY_DOUBLE_ || d->type_num == kNpyHalf ||
                    (bits16 && d->type_num == npd::npy_api::NPY_USHORT_);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  const bool native = d->byteorder != '<';
#else
  const bool native = d->byteorder != '>';
#endif
  if (!fast || !native || !(a->flags & npd::npy_api::NPY_ARRAY_ALIGNED_) || a->nd > kMaxNd)
    return false;
  static_assert(sizeof(*a->dimensions) == sizeof(int64_t), "npy_intp is 64-bit here");
  r = KeyedArray{d->type_num, a->nd, reinterpret_cast<const int64_t*>(a->dimensions),
                 reinterpret_cast<const int64_t*>(a->strides)};
  return true;
}

bool array_key(PyObject* x, bool bits16, KeyWords& key) {
  KeyedArray r;
  if (!read_array(x, bits16, r)) return false;
  key.array(r.type_num, r.nd, r.dims, r.strides);
  return true;
}

// A one-row call (q (B, Hq, 1, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv), Lk >= 1, no
// out=) whose plan is a decode plan serves every Lk and any k / v strides: choose_kernel
// picks the decode kernel for one query row whatever Lk, the plain call's record does
// not depend on Lk, and the kernel reads k / v through their strides as the checked path
// passes them. Its second key (lk_free_key): the header, q's words, and k / v without
// the key count or strides (KeyWords::free_kv).
bool one_row(const KeyedArray* r) {
  return r[0].nd == 4 && r[0].dims[2] == 1 && r[1].nd == 4 && r[2].nd == 4 &&
         r[1].dims[2] == r[2].dims[2] && r[1].dims[2] >= 1;
}
KeyWords one_row_key(const int64_t* header, const KeyedArray* r) {
  KeyWords key;
  key.w[key.n++] = header[0], key.w[key.n++] = header[1];
  key.array(r[0].type_num, 4, r[0].dims, r[0].strides);
  key.free_kv(r[1].type_num, r[1].dims);
  key.free_kv(r[2].type_num, r[2].dims);
  return key;
}

// plans[key], borrowed, or null (no plan).
PyObject* find_plan(const py::dict& plans, const KeyWords& key, const char* prefix) {
  PyObject* plan = PyDict_GetItemWithError(plans.ptr(), key.bytes(prefix).ptr());
  if (!plan && PyErr_Occurred()) throw py::error_already_set();
  return plan;
}

// functional._PLANS's key of a plain call: the bytes of is_causal, enable_gqa, scale
// (None or a float) and each array's dtype number, shape and strides (out's too when
// given); None when an array is not what array_key reads. Everything the checked path's
// acceptance and choices depended on, read in one call instead of ~30 Python operations.
py::object plan_key(py::handle q, py::handle k, py::handle v, py::handle out, bool is_causal,
                    bool enable_gqa, py::handle scale, bool bits16) {
  KeyWords key;
  if (!key.header(is_causal, enable_gqa, !out.is_none(), scale.ptr())) return py::none();
  const py::handle arrays[4] = {q, k, v, out};
  for (int i = 0; i < (out.is_none() ? 3 : 4); ++i)
    if (!array_key(arrays[i].ptr(), bits16, key)) return py::none();
  return key.bytes();
}

// The second key of a one-row decode plan (one_row) from its exact key (plan_key's
// bytes, after b"t" for tensors), or None when the call is not one_row's.
py::object lk_free_key(py::bytes exact) {
  const char* p = PyBytes_AS_STRING(exact.ptr());
  Py_ssize_t nb = PyBytes_GET_SIZE(exact.ptr());
  const bool tensor = nb % Py_ssize_t(sizeof(int64_t)) == 1 && p[0] == 't';
  p += tensor, nb -= tensor;
  const int64_t n = nb / int64_t(sizeof(int64_t));
  if (nb % Py_ssize_t(sizeof(int64_t)) || n != 2 + 3 * 9) return py::none();  // 3 arrays, 4-D
  int64_t w[2 + 3 * 9];
  std::memcpy(w, p, size_t(nb));
  if (w[0] & 4) return py::none();  // has out=
  KeyedArray r[3];
  for (int i = 0; i < 3; ++i) {
    const int64_t* a = w + 2 + 9 * i;
    if ((a[0] >> 16) != 4) return py::none();
    r[i] = KeyedArray{int(a[0] & 0xffff), 4, a + 1, a + 5};
  }
  if (!one_row(r)) return py::none();
  return one_row_key(w, r).bytes(tensor ? "t" : "");
}

// DLPack's C exchange table (DLPack 1.2+: the capsule "dlpack_exchange_api" that a
// framework sets on its tensor type as __dlpack_c_exchange_api__), declared here in the
// layout of DLPack's major version 1 so that nothing includes a framework's header. Its
// dltensor_from_py_object_no_sync fills a caller-owned DLTensor (no allocation, no
// reference taken): a tensor's dtype, device, sizes, strides (in elements) and data in
// one C call, where reading them as Python attributes takes six.
struct DlTensor {
  void* data;
  int32_t device_type, device_id;
  int32_t ndim;
  uint8_t code, bits;
  uint16_t lanes;
  int64_t* shape;
  int64_t* strides;  // in elements
  uint64_t byte_offset;
};
struct DlExchangeApi {
  uint32_t major, minor;  // the table's DLPack version
  void* prev_api;
  void *allocator, *managed_from_py, *managed_to_py;        // not used here
  int (*dltensor_from_py)(void* py_object, DlTensor* out);  // may be null
  void* current_work_stream;
};
constexpr int32_t kDlCpu = 1;
constexpr uint8_t kDlFloat = 2, kDlBfloat = 4;

// What run_plan needs of torch, handed over by set_torch once torch is
// imported (attn_fast._checks): the tensor type, the float dtypes, the strided
// layout, from_numpy, and the three states under which a call must go through
// torch's dispatcher (functorch transforms, dispatch modes, torch-function modes).
struct TorchKinds {
  py::object tensor, f32, f64, f16, bf16, strided, from_numpy;
  py::object functorch_active, dispatch_stack_len, function_mode_on;
  bool set = false;
  const DlExchangeApi* dlpack = nullptr;  // the tensor type's C exchange table, if usable
};

TorchKinds& torch_kinds() {
  static TorchKinds* k = new TorchKinds;  // never destroyed: no Python calls at exit
  return *k;
}

// The exchange table in `capsule` (torch.Tensor.__dlpack_c_exchange_api__), or null (the
// attribute reader) for None, another object, another major version or a table without
// the non-owning reader.
const DlExchangeApi* exchange_table(py::handle capsule) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dlpack_exchange_api")) return nullptr;
  const auto* api =
      static_cast<const DlExchangeApi*>(PyCapsule_GetPointer(capsule.ptr(), "dlpack_exchange_api"));
  return api && api->major == 1 && api->dltensor_from_py ? api : nullptr;
}

// One tensor as a NumPy view would see it (the fields of its plan key, and its memory).
struct TensorRead {
  int type_num = 0, itemsize = 0, nd = 0;
  int64_t dims[kMaxNd], strides[kMaxNd];  // strides in bytes
  void* data = nullptr;
};

// A Python attribute (call = false) or no-argument method result (call = true) that must
// be one of `want` objects by identity; -1 on error (cleared), else its index.
int attr_is(PyObject* x, PyObject* name, bool call, PyObject* const* want, int nwant) {
  PyObject* r = call ? PyObject_CallMethodNoArgs(x, name) : PyObject_GetAttr(x, name);
  if (!r) {
    PyErr_Clear();
    return -1;
  }
  int found = -1;
  for (int i = 0; i < nwant && found < 0; ++i)
    if (r == want[i]) found = i;
  Py_DECREF(r);
  return found;
}

// The int64 items of a tuple (torch.Size or stride()'s tuple) into out; false unless it
// is a tuple of at most kMaxNd ints.
bool tuple_ints(PyObject* t, int64_t* out, int* nd) {
  if (!t || !PyTuple_Check(t) || PyTuple_GET_SIZE(t) > kMaxNd) return false;
  *nd = int(PyTuple_GET_SIZE(t));
  for (int j = 0; j < *nd; ++j) {
    out[j] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, j));
    if (out[j] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// x's dtype (kind: index into TorchKinds' float dtypes), sizes, strides (in elements)
// and data by the DLPack exchange table; false, with no Python error set, unless x is a
// CPU float tensor of at most kMaxNd dimensions the table describes. Tensors without
// strides (sparse, mkldnn, nested layouts) are refused by the table itself.
bool read_dlpack(const DlExchangeApi& api, PyObject* x, TensorRead& r, int* kind) {
  DlTensor t;
  if (api.dltensor_from_py(x, &t) != 0) {
    PyErr_Clear();
    return false;
  }
  if (t.device_type != kDlCpu || t.lanes != 1 || t.ndim < 0 || t.ndim > kMaxNd ||
      (t.ndim > 0 && (!t.shape || !t.strides)))
    return false;
  if (t.code == kDlFloat && (t.bits == 32 || t.bits == 64 || t.bits == 16))
    *kind = t.bits == 32 ? 0 : t.bits == 64 ? 1 : 2;
  else if (t.code == kDlBfloat && t.bits == 16)
    *kind = 3;
  else
    return false;
  r.nd = t.ndim;
  for (int j = 0; j < r.nd; ++j) r.dims[j] = t.shape[j], r.strides[j] = t.strides[j];
  r.data = static_cast<char*>(t.data) + t.byte_offset;
  return true;
}

// Reads `x` as Tensor.numpy() would (bfloat16 as its uint16 bits); false, with no
// Python error set, for anything that is not an exact CPU strided float tensor without
// grad or negative bit, with aligned data (and memory, if it has elements). Through the
// DLPack exchange table where torch has one (the grad and negative bits are not DLPack's:
// two attributes), else through six attributes more.
bool read_tensor(const TorchKinds& tk, PyObject* x, TensorRead& r) {
  static PyObject* s_dtype = PyUnicode_InternFromString("dtype");
  static PyObject* s_is_cpu = PyUnicode_InternFromString("is_cpu");
  static PyObject* s_layout = PyUnicode_InternFromString("layout");
  static PyObject* s_requires_grad = PyUnicode_InternFromString("requires_grad");
  static PyObject* s_is_neg = PyUnicode_InternFromString("is_neg");
  static PyObject* s_shape = PyUnicode_InternFromString("shape");
  static PyObject* s_stride = PyUnicode_InternFromString("stride");
  static PyObject* s_data_ptr = PyUnicode_InternFromString("data_ptr");
  if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(tk.tensor.ptr())) return false;
  static const int nums[4] = {npd::npy_api::NPY_FLOAT_, npd::npy_api::NPY_DOUBLE_, kNpyHalf,
                              npd::npy_api::NPY_USHORT_};
  static const int sizes[4] = {4, 8, 2, 2};
  PyObject* const no = Py_False;
  int kind = -1;
  if (tk.dlpack) {
    if (!read_dlpack(*tk.dlpack, x, r, &kind) || attr_is(x, s_requires_grad, false, &no, 1) < 0 ||
        attr_is(x, s_is_neg, true, &no, 1) < 0)
      return false;
  } else {
    PyObject* const dtypes[4] = {tk.f32.ptr(), tk.f64.ptr(), tk.f16.ptr(), tk.bf16.ptr()};
    PyObject* const yes = Py_True;
    PyObject* const strided = tk.strided.ptr();
    kind = attr_is(x, s_dtype, false, dtypes, 4);
    if (kind < 0 || attr_is(x, s_is_cpu, false, &yes, 1) < 0 ||
        attr_is(x, s_layout, false, &strided, 1) < 0 ||
        attr_is(x, s_requires_grad, false, &no, 1) < 0 || attr_is(x, s_is_neg, true, &no, 1) < 0)
      return false;
    PyObject* shape = PyObject_GetAttr(x, s_shape);
    PyObject* strides = shape ? PyObject_CallMethodNoArgs(x, s_stride) : nullptr;
    PyObject* ptr = strides ? PyObject_CallMethodNoArgs(x, s_data_ptr) : nullptr;
    int nd_s = -1;
    const bool ok = tuple_ints(shape, r.dims, &r.nd) && tuple_ints(strides, r.strides, &nd_s) &&
                    nd_s == r.nd && ptr && PyLong_Check(ptr);
    if (ok) r.data = PyLong_AsVoidPtr(ptr);
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(ptr);
    if (!ok || PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  r.type_num = nums[kind];
  r.itemsize = sizes[kind];
  int64_t numel = 1;
  for (int j = 0; j < r.nd; ++j) numel *= r.dims[j];
  // no memory behind elements (a ZeroTensor: data_ptr() 0): Tensor.numpy() refuses it
  if (reinterpret_cast<uintptr_t>(r.data) % uintptr_t(r.itemsize) != 0 || (!r.data && numel))
    return false;
  for (int j = 0; j < r.nd; ++j) r.strides[j] *= r.itemsize;
  return true;
}

// True when a torch call must go through its dispatcher (the states of _direct_ok).
bool torch_modes_on(const TorchKinds& tk) {
  for (const py::object* f : {&tk.functorch_active, &tk.dispatch_stack_len, &tk.function_mode_on}) {
    PyObject* r = PyObject_CallNoArgs(f->ptr());
    const int on = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    if (on != 0) {
      PyErr_Clear();
      return true;
    }
  }
  return false;
}

// A NumPy array over memory that `owner` (its base) keeps alive, or, with no owner,
// a new C-contiguous one (data and strides ignored). NumPy's C API directly: pybind11's
// py::array constructor builds a std::vector and a dtype object per array, on a path that
// runs once per layer per token.
py::object numpy_view(int type_num, int nd, const int64_t* dims, const int64_t* strides, void* data,
                      PyObject* owner) {
  const auto& api = npd::npy_api::get();
  PyObject* descr = api.PyArray_DescrFromType_(type_num);  // stolen by NewFromDescr
  if (!descr) throw py::error_already_set();
  // An empty tensor may have no memory (data_ptr() 0): a view must not allocate, and
  // NumPy never reads an empty array's data.
  alignas(64) static char no_elements[64];
  if (!owner)
    data = nullptr, strides = nullptr;
  else if (!data)
    data = no_elements;
  const int flags =
      data ? npd::npy_api::NPY_ARRAY_ALIGNED_ | npd::npy_api::NPY_ARRAY_WRITEABLE_ : 0;
  PyObject* a = api.PyArray_NewFromDescr_(
      api.PyArray_Type_, descr, nd, reinterpret_cast<const Py_intptr_t*>(dims),
      reinterpret_cast<const Py_intptr_t*>(strides), data, flags, nullptr);
  if (!a) throw py::error_already_set();
  auto arr = py::reinterpret_steal<py::object>(a);
  if (owner) {
    Py_INCREF(owner);  // stolen by SetBaseObject
    if (api.PyArray_SetBaseObject_(a, owner) < 0) throw py::error_already_set();
  }
  return arr;
}

// functional._run_plan's steps for a call without out=: a new output of the plan's
// shape and dtype, and the plan's bound kernel call (run, checked scale, shape, dtype)
// on q, k, v's views (made by `views` only when the output is not empty).
template <typename Views>
py::object call_plan(PyObject* plan, py::handle scale, Views&& views) {
  const py::tuple p = py::reinterpret_borrow<py::tuple>(plan);
  const py::object s =
      scale.is_none() ? py::object(p[1]) : py::reinterpret_borrow<py::object>(scale);
  int64_t odims[kMaxNd];
  int ond = 0;
  if (!tuple_ints(p[2].ptr(), odims, &ond)) throw py::error_already_set();
  const int otype = npd::array_descriptor_proxy(p[3].ptr())->type_num;
  py::object o = numpy_view(otype, ond, odims, nullptr, nullptr, nullptr);
  int64_t size = 1;
  for (int j = 0; j < ond; ++j) size *= odims[j];
  if (size) {
    py::object v[3];
    views(v);
    if (!call_bound_decode(p[0], v[0], v[1], v[2], o, s)) p[0](v[0], v[1], v[2], o, s);
  }
  return o;
}

// A NumPy result as the tensor _checks.to_input_kind makes of it (sharing its memory).
py::object as_tensor(const TorchKinds& tk, py::object o) {
  const auto* oa = npd::array_proxy(o.ptr());
  if (npd::array_descriptor_proxy(oa->descr)->type_num != npd::npy_api::NPY_USHORT_)
    return tk.from_numpy(o);
  // bfloat16 bits: torch reads them as int16 (every torch version), then as bfloat16.
  py::object bits =
      numpy_view(npd::npy_api::NPY_SHORT_, oa->nd, reinterpret_cast<const int64_t*>(oa->dimensions),
                 nullptr, oa->data, o.ptr());  // o is C-contiguous: strides null
  return tk.from_numpy(bits).attr("view")(tk.bf16);
}

// The planned plain call (no out=) on NumPy arrays or torch tensors q, k, v: what
// functional.scaled_dot_product_attention returns for them once a checked call of the
// same key stored its plan in `plans`, bit for bit; None when an input is not a
// fast-path kind, torch's modes are on, or there is no plan yet (the caller then takes
// the checked path, which stores it). Tensors are keyed as their NumPy views, after b"t".
py::object run_plan(py::dict plans, py::handle q, py::handle k, py::handle v, bool is_causal,
                    bool enable_gqa, py::handle scale) {
  KeyWords key;
  if (!key.header(is_causal, enable_gqa, false, scale.ptr())) return py::none();
  const py::handle in[3] = {q, k, v};
  KeyedArray a[3];
  if (Py_TYPE(q.ptr()) == npd::npy_api::get().PyArray_Type_) {
    for (int i = 0; i < 3; ++i) {
      if (!read_array(in[i].ptr(), false, a[i])) return py::none();
      key.array(a[i].type_num, a[i].nd, a[i].dims, a[i].strides);
    }
    PyObject* plan = find_plan(plans, key, "");
    if (!plan && one_row(a)) plan = find_plan(plans, one_row_key(key.w, a), "");
    if (!plan) return py::none();
    return call_plan(plan, scale, [&](py::object* views) {
      for (int i = 0; i < 3; ++i) views[i] = py::reinterpret_borrow<py::object>(in[i]);
    });
  }
  const TorchKinds& tk = torch_kinds();
  if (!tk.set) return py::none();
  TensorRead r[3];
  for (int i = 0; i < 3; ++i) {
    if (!read_tensor(tk, in[i].ptr(), r[i])) return py::none();
    a[i] = KeyedArray{r[i].type_num, r[i].nd, r[i].dims, r[i].strides};
    key.array(a[i].type_num, a[i].nd, a[i].dims, a[i].strides);
  }
  if (torch_modes_on(tk)) return py::none();
  PyObject* plan = find_plan(plans, key, "t");
  if (!plan && one_row(a)) plan = find_plan(plans, one_row_key(key.w, a), "t");
  if (!plan) return py::none();
  return as_tensor(tk, call_plan(plan, scale, [&](py::object* views) {
                     for (int i = 0; i < 3; ++i)
                       views[i] = numpy_view(r[i].type_num, r[i].nd, r[i].dims, r[i].strides,
                                             r[i].data, in[i].ptr());
                   }));
}

// The three tensors' views into views[]; false (views untouched) when torch is not handed
// over yet or one tensor is not a kind read_tensor reads.
bool read_views(const py::handle* in, py::object* views) {
  const TorchKinds& tk = torch_kinds();
  if (!tk.set) return false;
  TensorRead r[3];
  for (int i = 0; i < 3; ++i)
    if (!read_tensor(tk, in[i].ptr(), r[i])) return false;
  for (int i = 0; i < 3; ++i)
    views[i] = numpy_view(r[i].type_num, r[i].nd, r[i].dims, r[i].strides, r[i].data, in[i].ptr());
  return true;
}

// q, k, v (torch tensors) as the NumPy views Tensor.numpy() would give (bfloat16 as
// its uint16 bits), or None when one is not a kind read_tensor reads; torch's modes
// are not looked at (a caller that must respect them asks first).
py::object tensor_views(py::handle q, py::handle k, py::handle v) {
  const py::handle in[3] = {q, k, v};
  py::object views[3];
  if (!read_views(in, views)) return py::none();
  return py::make_tuple(views[0], views[1], views[2]);
}

// KVCache._step in one call: the three inputs' views (exact NumPy arrays, or tensors
// read_tensor reads; anything else gives None), then ring_append_step. With heads_last the
// result (B, Hq, 1, dv) is returned as (B, 1, Hq, dv), the same memory for one row (the
// transformers backend's output order); a tensor for tensor inputs.
py::object cache_step(py::handle ring, py::handle q, py::handle k, py::handle v, py::handle scale,
                      int64_t window_left, const py::array& n, const py::array& start,
                      const py::array& pos, const py::array& last_new, bool heads_last) {
  const py::handle in[3] = {q, k, v};
  py::object views[3];
  const auto ndarray = npd::npy_api::get().PyArray_Type_;
  const bool tensors = Py_TYPE(q.ptr()) != ndarray;
  if (tensors) {
    if (!read_views(in, views)) return py::none();
  } else {
    for (int i = 0; i < 3; ++i) {
      if (Py_TYPE(in[i].ptr()) != ndarray) return py::none();
      views[i] = py::reinterpret_borrow<py::object>(in[i]);
    }
  }
  py::object o = ring_append_step(ring, views[0], views[1], views[2], scale, window_left, n, start,
                                  pos, last_new);
  if (o.is_none()) return o;
  if (heads_last) {
    const auto* oa = npd::array_proxy(o.ptr());
    const int64_t* od = reinterpret_cast<const int64_t*>(oa->dimensions);
    const int64_t dims[4] = {od[0], od[2], od[1], od[3]};  // od[2] == 1
    o = numpy_view(npd::array_descriptor_proxy(oa->descr)->type_num, 4, dims, nullptr, oa->data,
                   o.ptr());
  }
  return tensors ? as_tensor(torch_kinds(), o) : o;
}

}  // namespace

void def_plans(py::module_& m) {
  m.def("plan_key", &plan_key, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("is_causal"), py::arg("enable_gqa"), py::arg("scale"), py::arg("bits16") = false,
        "The plan key (bytes) of a plain scaled_dot_product_attention call on exact, aligned "
        "float32 / float64 / float16 (with bits16 also uint16) numpy.ndarrays, or None for any "
        "other input.");
  m.def(
      "set_torch",
      [](py::object tensor, py::object f32, py::object f64, py::object f16, py::object bf16,
         py::object strided, py::object from_numpy, py::object functorch_active,
         py::object dispatch_stack_len, py::object function_mode_on, py::object dlpack_api) {
        TorchKinds& tk = torch_kinds();
        tk = TorchKinds{tensor,
                        f32,
                        f64,
                        f16,
                        bf16,
                        strided,
                        from_numpy,
                        functorch_active,
                        dispatch_stack_len,
                        function_mode_on,
                        true};
        tk.dlpack = exchange_table(dlpack_api);
      },
      py::arg("tensor"), py::arg("f32"), py::arg("f64"), py::arg("f16"), py::arg("bf16"),
      py::arg("strided"), py::arg("from_numpy"), py::arg("functorch_active"),
      py::arg("dispatch_stack_len"), py::arg("function_mode_on"),
      py::arg("dlpack_api") = py::none(),
      "Hand torch's tensor type, float dtypes, strided layout, from_numpy, its three "
      "dispatch-state queries and its DLPack exchange table (None: read tensors by their "
      "attributes) to run_plan (when torch is imported).");
  m.def("lk_free_key", &lk_free_key, py::arg("key"),
        "The second key of a one-row decode plan, which serves every key count and k / v "
        "strides, from its exact plan key (bytes); None when the call is not one row against "
        "4-D k, v without out=.");
  m.def("tensor_views", &tensor_views, py::arg("q"), py::arg("k"), py::arg("v"),
        "NumPy views of torch tensors q, k, v (bfloat16 as uint16 bits), or None when one "
        "is not an exact CPU strided float tensor without grad or negative bit.");
  m.def("cache_step", &cache_step, py::arg("ring"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("scale"), py::arg("window_left"), py::arg("n"), py::arg("start"), py::arg("pos"),
        py::arg("last_new"), py::arg("heads_last"),
        "KVCache._step: append one row per sequence (k, v) to a DecodeRing and attend q to "
        "it, updating the cache's counters n, start, pos, last_new in place; the (B, Hq, 1, "
        "dv) result (heads_last: (B, 1, Hq, dv)) in the inputs' kind (NumPy arrays or torch "
        "tensors), or None, with nothing changed, where the pair takes the checked path.");
  m.def("run_plan", &run_plan, py::arg("plans"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("is_causal"), py::arg("enable_gqa"), py::arg("scale"),
        "The planned plain scaled_dot_product_attention call (no out=) on NumPy arrays or "
        "torch tensors q, k, v: its result, or None when the call must take the checked path.");
}

}  // namespace bindings
}  // namespace attn_fast
