// The decode kernel's binding: one `decode` for every layout (an array or a
// KV cache's ring of slots; a paged pool through a block table) and every
// encoding of the rows (float32, float64, float16, bfloat16 bits, or a coded
// encoding: one-byte codes with float32 side arrays, named by encoding=). The
// call's arguments become one DecodeCall, bound once; the layout follows from
// block_table, the encoding from encoding= (its KvEncodingDesc says what to
// check) or else k's dtype, and one template (decode_t) fills DecodeArgs for
// the kernel. Also the int8 cache's
// quantising append, whose layout the int8 encoding reads.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attn_fast/attention.h"
#include "bindings_common.h"

namespace attn_fast {
namespace bindings {

namespace {

// The bound arguments of one _core.decode call (kept alive by the caller for
// the call): k, v are 4-D arrays, or lists of pool chunks when block_table is
// given; encoding, aux, group a coded encoding's name, side arrays (arrays, or
// lists of chunks for a pool) and key group.
struct DecodeCall {
  py::array q, o;
  py::object k, v, lse;
  double scale;
  bool causal, top_left;
  int64_t window_left, window_right;
  py::object q_lens, kv_lens, kv_start;
  int64_t split;
  py::object block_table;
  std::string encoding;  // "": rows of q's dtype; else a coded encoding's name
  py::object aux;
  int64_t group;
};

// A call's coded encoding: its descriptor and DecodeArgs::coding tag.
struct Coded {
  const KvEncodingDesc* desc = nullptr;
  int tag = 0;
};
// One-byte k / v elements are a coded encoding's codes.
template <typename KV>
constexpr bool kCoded = sizeof(KV) == 1;

std::string coded_dtype_error(const Coded& cd) {
  return std::string("encoding '") + cd.desc->name + "' takes float32 q and o, " +
         (cd.desc->code_signed ? "int8" : "uint8") + " codes k and v";
}

// The side arrays of a coded call (a sequence of the encoding's naux), in
// the encoding's order.
py::sequence aux_items(const DecodeCall& c, const Coded& cd) {
  const KvEncodingDesc& e = *cd.desc;
  const bool seq = !c.aux.is_none() && py::isinstance<py::sequence>(c.aux);
  const int n = seq ? static_cast<int>(py::len(c.aux)) : 0;
  if (n == e.naux) return py::reinterpret_borrow<py::sequence>(c.aux);
  std::string names;
  for (int i = 0; i < e.naux; ++i) names += std::string(i ? ", " : "") + e.aux[i].name;
  throw py::value_error(
      std::string("encoding '") + e.name + "' takes aux = (" + names + "): got " +
      std::to_string(n) + " arrays" +
      (n < e.naux ? std::string(", ") + e.aux[n].name + " is required" : std::string()));
}

// The key group of a coded call over `slots` (R, or a page's block_size).
void bind_group(DecodeArgs<float>& a, const DecodeCall& c, const Coded& cd, int64_t slots,
                const char* what) {
  if (!cd.desc->grouped) {
    a.group = 1;
    return;
  }
  if (c.group < 1 || slots % c.group != 0)
    throw py::value_error(std::string("group must be >= 1 and divide ") + what);
  a.group = c.group;
}

// q (B, Hq, Lq, d), o (B, Hq, Lq, dv) of storage type T and the options.
// q (B, Hq, Lq, d): its strides, data and sizes, and the scale, checked.
template <typename T>
void bind_q(DecodeArgs<T>& a, const py::array& q, double scale) {
  a.sq = strides4(q, "q");
  a.q = static_cast<const T*>(q.data());
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.Lq = q.shape(2);
  a.d = q.shape(3);
  // A scale finite as a double but not in the compute type would turn every
  // score into inf or NaN: refuse it (the Python layer says so first).
  if (!(std::fabs(scale) <= static_cast<double>(std::numeric_limits<compute_t<T>>::max())))
    throw py::value_error("scale = " + py::str(py::float_(scale)).cast<std::string>() +
                          " is out of the range of the inputs' dtype");
  a.scale = scale;
}

template <typename T, typename KV>
void bind_q_o(DecodeArgs<T>& a, const DecodeCall& c, const Coded& cd) {
  if (!has_dtype<T>(c.o))
    throw py::type_error(kCoded<KV> ? coded_dtype_error(cd) : "q, k, v, o must share one dtype");
  if (!c.o.writeable()) throw py::value_error("o is read-only");
  bind_q(a, c.q, c.scale);
  a.so = strides4(c.o, "o");
  a.o = static_cast<T*>(py::array(c.o).mutable_data());
  a.causal = c.causal;
  a.top_left = c.top_left;
  a.window_left = clamp_window(c.window_left);
  a.window_right = clamp_window(c.window_right);
}

// The slots' sizes against q's (bound in a): k (B, Hkv, R, d), v (B, Hkv, R,
// dv), Hq a multiple of Hkv; sets Hkv, R and dv. The checked call's and the
// bound ring's (per call: q differs between calls).
template <typename T>
void bind_slot_sizes(DecodeArgs<T>& a, const py::array& k, const py::array& v) {
  a.Hkv = k.shape(1);
  a.R = k.shape(2);
  a.dv = v.shape(3);
  if (k.shape(0) != a.B || v.shape(0) != a.B || k.shape(3) != a.d || v.shape(2) != a.R ||
      v.shape(1) != a.Hkv)
    throw py::value_error("inconsistent q/k/v/o shapes");
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0) throw py::value_error("Hq must be a multiple of Hkv");
}

// Slots: k (B, Hkv, R, d), v (B, Hkv, R, dv), any strides (codes: element
// stride 1, and the side arrays contiguous (B, Hkv, R / group, d) or (B, Hkv,
// R) as the encoding declares).
template <typename T, typename KV>
void bind_slots(DecodeArgs<T>& a, const DecodeCall& c, const py::array& k, const py::array& v,
                const Coded& cd) {
  if (!has_dtype<KV>(k) || !has_dtype<KV>(v))
    throw py::type_error(kCoded<KV> ? coded_dtype_error(cd) : "q, k, v, o must share one dtype");
  a.sk = strides4(k, "k");
  a.sv = strides4(v, "v");
  if (c.o.ndim() != 4 || c.o.shape(0) != a.B || c.o.shape(1) != a.Hq || c.o.shape(2) != a.Lq ||
      c.o.shape(3) != v.shape(3))
    throw py::value_error("inconsistent q/k/v/o shapes");
  bind_slot_sizes(a, k, v);
  if constexpr (kCoded<KV>) {
    if (a.sk.d != 1 || a.sv.d != 1)
      throw py::value_error(std::string(cd.desc->name) + " k and v need element stride 1 along d");
    bind_group(a, c, cd, a.R, "the slots R");
    const auto items = aux_items(c, cd);
    for (int i = 0; i < cd.desc->naux; ++i) {
      const KvAux& x = cd.desc->aux[i];
      const py::object item = items[i];
      a.aux[i] = x.per_group
                     ? exact_array<float>(item, x.name, {a.B, a.Hkv, a.R / a.group, a.d}, false)
                     : exact_array<float>(item, x.name, {a.B, a.Hkv, a.R}, false);
    }
    a.kc = k.data();
    a.vc = v.data();
    a.coding = cd.tag;
  } else {
    a.k = static_cast<const T*>(k.data());
    a.v = static_cast<const T*>(v.data());
  }
}

// A pool's chunk pointers, alive for the call.
template <typename KV>
struct Pool {
  std::vector<const KV*> k, v;
  std::vector<const float*> aux[kKvMaxAux];  // a coded encoding's side arrays
};

// The chunks (chunk_blocks, Hkv, block_size, dim) of one list: one dtype KV,
// one shape (that of chunk 0 of k, with dim) and one set of strides each.
template <typename KV>
std::vector<const KV*> pool_chunks(const py::list& chunks, const char* name, int64_t dim,
                                   const py::array& like, Strides4* st) {
  std::vector<const KV*> out;
  for (py::ssize_t c = 0; c < static_cast<py::ssize_t>(chunks.size()); ++c) {
    auto x = py::cast<py::array>(chunks[c]);
    if (!has_dtype<KV>(x))
      throw py::type_error(
          std::string(name) + " chunks must have " +
          (kCoded<KV> ? (std::is_signed<KV>::value ? "int8 codes" : "uint8 codes") : "q's dtype"));
    if (x.ndim() != 4) throw py::value_error(std::string(name) + " chunks must be 4-D");
    const Strides4 s = strides4(x, name);
    if (c == 0) {
      *st = s;
    } else if (s.b != st->b || s.h != st->h || s.l != st->l || s.d != st->d) {
      throw py::value_error(std::string(name) + " chunks must share one set of strides");
    }
    if (x.shape(0) != like.shape(0) || x.shape(1) != like.shape(1) || x.shape(2) != like.shape(2) ||
        x.shape(3) != dim)
      throw py::value_error(std::string(name) + " chunk " + std::to_string(c) + " has shape " +
                            shape_of(x) + ", expected (" + std::to_string(like.shape(0)) + ", " +
                            std::to_string(like.shape(1)) + ", " + std::to_string(like.shape(2)) +
                            ", " + std::to_string(dim) + ")");
    out.push_back(static_cast<const KV*>(x.data()));
  }
  return out;
}

// The side array chunks of a coded pool: one C-contiguous float32 array of
// this shape per chunk.
std::vector<const float*> scale_chunks(const py::object& lst, const char* name, size_t n,
                                       std::initializer_list<int64_t> shape) {
  if (lst.is_none() || !py::isinstance<py::list>(lst))
    throw py::value_error(std::string(name) + " must be a list of chunks for a pool");
  auto l = py::cast<py::list>(lst);
  if (l.size() != n)
    throw py::value_error(std::string(name) + " must hold one array per pool chunk");
  std::vector<const float*> out;
  for (auto item : l)
    out.push_back(exact_array<float>(py::reinterpret_borrow<py::object>(item), name, shape, false));
  return out;
}

// Pages: k, v lists of pool chunks (chunk_blocks, Hkv, block_size, d / dv);
// block_table C-contiguous int64 (B, max_blocks); kv_lens required, each <=
// max_blocks * block_size, and the first ceil(kv_lens[b] / block_size)
// entries of row b name blocks of the pool. Everything the kernel would read
// out of bounds is checked here.
template <typename T, typename KV>
void bind_pages(DecodeArgs<T>& a, const DecodeCall& c, const py::list& kl, const py::list& vl,
                Pool<KV>* pool, const Coded& cd) {
  if (kl.size() == 0 || kl.size() != vl.size())
    throw py::value_error("k_chunks and v_chunks must be non-empty lists of one length");
  const auto k0 = py::cast<py::array>(kl[0]);
  const auto v0 = py::cast<py::array>(vl[0]);
  pool->k = pool_chunks<KV>(kl, "k", a.d, k0, &a.sk);
  if (v0.ndim() != 4) throw py::value_error("v chunks must be 4-D");
  a.dv = v0.shape(3);
  pool->v = pool_chunks<KV>(vl, "v", a.dv, k0, &a.sv);
  a.chunk_blocks = k0.shape(0);
  a.Hkv = k0.shape(1);
  a.block_size = k0.shape(2);
  if (a.chunk_blocks < 1 || a.block_size < 1) throw py::value_error("empty pool chunks");
  if (c.o.ndim() != 4 || c.o.shape(0) != a.B || c.o.shape(1) != a.Hq || c.o.shape(2) != a.Lq ||
      c.o.shape(3) != a.dv)
    throw py::value_error("o has shape " + shape_of(c.o) + ", expected (B, Hq, Lq, dv) of q " +
                          shape_of(c.q) + " and the pool's dv");
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0) throw py::value_error("Hq must be a multiple of Hkv");
  const auto table = py::cast<py::array>(c.block_table);
  if (!py::isinstance<py::array_t<int64_t>>(table) || !(table.flags() & py::array::c_style) ||
      table.ndim() != 2 || table.shape(0) != a.B)
    throw py::value_error("block_table must be a C-contiguous int64 array (B, max_blocks), got " +
                          shape_of(table));
  a.max_blocks = table.shape(1);
  a.R = a.max_blocks * a.block_size;
  a.block_table = static_cast<const int64_t*>(table.data());
  if (c.kv_lens.is_none()) throw py::value_error("kv_lens is required for a paged cache");
  if (!c.kv_start.is_none()) throw py::value_error("kv_start is not read with a block_table");
  const int64_t* lens = data_of<int64_t>(c.kv_lens, "kv_lens", a.B);
  const int64_t n_blocks = static_cast<int64_t>(pool->k.size()) * a.chunk_blocks;
  for (int64_t b = 0; b < a.B; ++b) {
    if (lens[b] < 0 || lens[b] > a.R)
      throw py::value_error("kv_lens[" + std::to_string(b) + "] = " + std::to_string(lens[b]) +
                            " is outside [0, max_blocks * block_size = " + std::to_string(a.R) +
                            "]");
    for (int64_t p = 0; p < (lens[b] + a.block_size - 1) / a.block_size; ++p) {
      const int64_t g = a.block_table[b * a.max_blocks + p];
      if (g < 0 || g >= n_blocks)
        throw py::value_error("block_table[" + std::to_string(b) + ", " + std::to_string(p) +
                              "] = " + std::to_string(g) + " is not a block of the pool of " +
                              std::to_string(n_blocks));
    }
  }
  if constexpr (kCoded<KV>) {
    if (a.sk.d != 1 || a.sv.d != 1)
      throw py::value_error(std::string(cd.desc->name) +
                            " k and v chunks need element stride 1 along d");
    bind_group(a, c, cd, a.block_size, "the block size");
    const auto items = aux_items(c, cd);
    const int64_t C = a.chunk_blocks;
    const size_t n = pool->k.size();
    for (int i = 0; i < cd.desc->naux; ++i) {
      const KvAux& x = cd.desc->aux[i];
      const py::object item = items[i];
      pool->aux[i] = x.per_group
                         ? scale_chunks(item, x.name, n, {C, a.Hkv, a.block_size / a.group, a.d})
                         : scale_chunks(item, x.name, n, {C, a.Hkv, a.block_size});
      a.aux_chunks[i] = pool->aux[i].data();
    }
    a.kc_chunks = reinterpret_cast<const void* const*>(pool->k.data());
    a.vc_chunks = reinterpret_cast<const void* const*>(pool->v.data());
    a.coding = cd.tag;
  } else {
    a.k_chunks = pool->k.data();
    a.v_chunks = pool->v.data();
  }
}

// One decode call with q of storage type T and rows of element type KV (T,
// or a coded encoding's int8_t / uint8_t codes): the layout's arguments, the
// lengths, the split, lse, then the kernel with the GIL released.
template <typename T, typename KV>
void decode_t(const DecodeCall& c, bool paged, const Coded& cd) {
  DecodeArgs<T> a;
  bind_q_o<T, KV>(a, c, cd);
  Pool<KV> pool;
  if (paged) {
    bind_pages<T, KV>(a, c, py::cast<py::list>(c.k), py::cast<py::list>(c.v), &pool, cd);
  }
  if (!paged) {
    const auto k = py::cast<py::array>(c.k), v = py::cast<py::array>(c.v);
    bind_slots<T, KV>(a, c, k, v, cd);
  }
  // A split longer than the keys is one split (no c0 + split overflow).
  a.split = c.split > a.R ? a.R : c.split;
  a.num_threads = threads_for_call();  // 1 in a forked child of a libgomp process
  a.q_lens = data_of<int64_t>(c.q_lens, "q_lens", a.B);
  a.kv_lens = data_of<int64_t>(c.kv_lens, "kv_lens", a.B);
  a.kv_start = data_of<int64_t>(c.kv_start, "kv_start", a.B);
  if (a.kv_start)
    for (int64_t b = 0; b < a.B; ++b)
      if (a.kv_start[b] < 0 || a.kv_start[b] >= (a.R > 0 ? a.R : 1))
        throw py::value_error("kv_start entries must lie in [0, R)");
  a.lse = lse_of<compute_t<T>>(c.lse, a.B * a.Hq * a.Lq, "B * Hq * Lq");
  {
    py::gil_scoped_release release;
    decode_forward(a);
  }
  raise_if_interrupted();
}

// The layout (block_table given: a pool) and the encoding (encoding=: a coded
// encoding's name; else q's storage type) of a call, then decode_t.
void decode(const DecodeCall& c) {
  const bool paged = !c.block_table.is_none();
  if (!c.encoding.empty()) {
    Coded cd;
    cd.desc = kv_encoding(c.encoding.c_str(), &cd.tag);
    if (!cd.desc) {
      std::string names;
      const KvEncodingDesc* e = nullptr;
      for (int t = 1; (e = kv_encoding(nullptr, &t)) != nullptr; ++t)
        names += std::string(t > 1 ? ", '" : "'") + e->name + "'";
      throw py::value_error("encoding must be " + names + " (or '' for rows of q's dtype), got '" +
                            c.encoding + "'");
    }
    if (!py::isinstance<py::array_t<float>>(c.q) || !py::isinstance<py::array_t<float>>(c.o))
      throw py::type_error(coded_dtype_error(cd));
    if (cd.desc->code_signed) return decode_t<float, int8_t>(c, paged, cd);
    return decode_t<float, uint8_t>(c, paged, cd);
  }
  by_dtype(c.q, [&](auto t) {
    decode_t<typename decltype(t)::type, typename decltype(t)::type>(c, paged, Coded{});
  });
}

// A KV cache's ring of slots bound once (KVCache.attend's planned decode):
// k (B, Hkv, R, d), v (B, Hkv, R, dv) of one float storage type, checked and
// held here, so that a call checks only what can differ between calls (q,
// the scale, the lengths) and parses eight arguments, not eighteen. The
// cache builds a new ring whenever it replaces its storage arrays (a resize
// never happens in place); a call runs decode_forward on the same DecodeArgs
// that decode() fills for these arrays, so it gives the same bits.
class DecodeRing {
 public:
  DecodeRing(py::array k, py::array v) : k_(std::move(k)), v_(std::move(v)) {
    type_ = by_dtype(k_, [&](auto t) {
      using T = typename decltype(t)::type;
      if (!has_dtype<T>(v_)) throw py::type_error("q, k, v, o must share one dtype");
      return kind<T>();
    });
    sk_ = strides4(k_, "k");
    sv_ = strides4(v_, "v");
    if (v_.shape(0) != k_.shape(0) || v_.shape(1) != k_.shape(1) || v_.shape(2) != k_.shape(2))
      throw py::value_error("k has shape " + shape_of(k_) + " but v has shape " + shape_of(v_));
    if (k_.shape(1) <= 0) throw py::value_error("Hq must be a multiple of Hkv");
  }

  // o (B, Hq, Lq, dv): a new C-contiguous array of q's dtype; None (and no
  // kernel call) when causal and some q_lens[b] > kv_lens[b]: rows that would
  // see past the stored keys, for which the caller's checked path raises.
  py::object call(const py::array& q, double scale, bool causal, int64_t window_left,
                  const py::object& q_lens, const py::object& kv_lens,
                  const py::object& kv_start) const {
    switch (type_) {
      case 0:
        return run<float>(q, scale, causal, window_left, q_lens, kv_lens, kv_start);
      case 1:
        return run<double>(q, scale, causal, window_left, q_lens, kv_lens, kv_start);
      case 2:
        return run<fp16_t>(q, scale, causal, window_left, q_lens, kv_lens, kv_start);
      default:
        return run<bf16_t>(q, scale, causal, window_left, q_lens, kv_lens, kv_start);
    }
  }

 private:
  template <typename T>
  static int kind() {
    if (std::is_same<T, float>::value) return 0;
    if (std::is_same<T, double>::value) return 1;
    return std::is_same<T, fp16_t>::value ? 2 : 3;
  }

 public:
  // KVCache._step: append() of one row per sequence (k (B, Hkv, 1, d), v (B, Hkv, 1, dv))
  // into this ring, then attend() of q (B, Hq, 1, d), causal, in one call: the same rows,
  // counters and kernel call (`run` with q_lens 1) as that pair, so the same bits. n,
  // start, pos, last_new: the cache's (B,) int64 counters, updated in place. scale: None
  // (1/sqrt(d)) or a float. None, with nothing changed, where the pair takes another path
  // (its checks raise there): a dtype, shape or scale the checked calls refuse, or a ring
  // without window that must grow for the row.
  py::object append_step(const py::array& q, const py::array& k, const py::array& v,
                         py::handle scale, int64_t window_left, const py::array& n,
                         const py::array& start, const py::array& pos, const py::array& last_new) {
    switch (type_) {
      case 0:
        return step<float>(q, k, v, scale, window_left, n, start, pos, last_new);
      case 1:
        return step<double>(q, k, v, scale, window_left, n, start, pos, last_new);
      case 2:
        return step<fp16_t>(q, k, v, scale, window_left, n, start, pos, last_new);
      default:
        return step<bf16_t>(q, k, v, scale, window_left, n, start, pos, last_new);
    }
  }

 private:
  // A (B,) C-contiguous writeable int64 counter array's data, or null.
  static int64_t* counter(const py::array& x, int64_t B) {
    if (!py::isinstance<py::array_t<int64_t>>(x) || x.ndim() != 1 || x.shape(0) != B ||
        !(x.flags() & py::array::c_style) || !x.writeable() ||
        reinterpret_cast<uintptr_t>(x.data()) % alignof(int64_t) != 0)
      return nullptr;
    return static_cast<int64_t*>(py::array(x).mutable_data());
  }

  template <typename T>
  py::object step(const py::array& q, const py::array& k, const py::array& v, py::handle scale,
                  int64_t window_left, const py::array& n, const py::array& start,
                  const py::array& pos, const py::array& last_new) {
    const int64_t B = k_.shape(0), Hkv = k_.shape(1), R = k_.shape(2), d = k_.shape(3),
                  dv = v_.shape(3);
    for (const py::array* x : {&q, &k, &v})
      if (!has_dtype<T>(*x) || x->ndim() != 4) return py::none();
    const int64_t Hq = q.shape(1);
    if (q.shape(0) != B || q.shape(2) != 1 || q.shape(3) != d || Hq <= 0 || Hq % Hkv != 0 ||
        k.shape(0) != B || k.shape(1) != Hkv || k.shape(2) != 1 || k.shape(3) != d ||
        v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != 1 || v.shape(3) != dv)
      return py::none();
    double s = 1.0 / std::sqrt(static_cast<double>(d));  // check_scale's default
    if (!scale.is_none()) {
      if (!PyFloat_CheckExact(scale.ptr())) return py::none();
      s = PyFloat_AS_DOUBLE(scale.ptr());
      if (!(std::fabs(s) <= static_cast<double>(std::numeric_limits<compute_t<T>>::max())))
        return py::none();
    }
    int64_t* cn = counter(n, B);
    int64_t* cs = counter(start, B);
    int64_t* cp = counter(pos, B);
    int64_t* cl = counter(last_new, B);
    if (!cn || !cs || !cp || !cl || R <= 0) return py::none();
    Strides4 sk, sv;
    try {
      strides4(q, "q");
      sk = strides4(k, "k");
      sv = strides4(v, "v");
    } catch (const py::value_error&) {
      return py::none();
    }
    for (int64_t b = 0; b < B; ++b)
      if (cn[b] < 0 || cn[b] > R || cs[b] < 0 || cs[b] >= R || (window_left < 0 && cn[b] == R))
        return py::none();
    // The row of sequence b goes to slot (start + n) mod R; a full window ring lets its
    // oldest row go (KVCache._advance's counters).
    const T* kr = static_cast<const T*>(k.data());
    const T* vr = static_cast<const T*>(v.data());
    T* K = static_cast<T*>(k_.mutable_data());
    T* V = static_cast<T*>(v_.mutable_data());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = (cs[b] + cn[b]) % R;
      for (int64_t h = 0; h < Hkv; ++h) {
        T* dk = K + b * sk_.b + h * sk_.h + slot * sk_.l;
        T* dvv = V + b * sv_.b + h * sv_.h + slot * sv_.l;
        const T* srck = kr + b * sk.b + h * sk.h;
        const T* srcv = vr + b * sv.b + h * sv.h;
        for (int64_t j = 0; j < d; ++j) dk[j * sk_.d] = srck[j * sk.d];
        for (int64_t j = 0; j < dv; ++j) dvv[j * sv_.d] = srcv[j * sv.d];
      }
      const int64_t n_new = std::min(R, cn[b] + 1);
      cs[b] = (cs[b] + cn[b] + 1 - n_new) % R;
      cn[b] = n_new;
      cp[b] += 1;
      cl[b] = 1;
    }
    return run<T>(q, s, true, window_left, last_new, n, start);
  }

  template <typename T>
  py::object run(const py::array& q, double scale, bool causal, int64_t window_left,
                 const py::object& q_lens, const py::object& kv_lens,
                 const py::object& kv_start) const {
    if (!has_dtype<T>(q)) throw py::type_error("q, k, v, o must share one dtype");
    DecodeArgs<T> a;
    bind_q(a, q, scale);
    bind_slot_sizes(a, k_, v_);
    py::array o(q.dtype(), std::vector<py::ssize_t>{a.B, a.Hq, a.Lq, a.dv});
    a.so = strides4(o, "o");
    a.o = static_cast<T*>(o.mutable_data());
    a.k = static_cast<const T*>(k_.data());
    a.v = static_cast<const T*>(v_.data());
    a.sk = sk_;
    a.sv = sv_;
    a.causal = causal;
    a.window_left = clamp_window(window_left);
    a.window_right = -1;
    a.split = 0;
    a.num_threads = threads_for_call();  // 1 in a forked child of a libgomp process
    a.q_lens = data_of<int64_t>(q_lens, "q_lens", a.B);
    a.kv_lens = data_of<int64_t>(kv_lens, "kv_lens", a.B);
    a.kv_start = data_of<int64_t>(kv_start, "kv_start", a.B);
    if (a.kv_start)
      for (int64_t b = 0; b < a.B; ++b)
        if (a.kv_start[b] < 0 || a.kv_start[b] >= (a.R > 0 ? a.R : 1))
          throw py::value_error("kv_start entries must lie in [0, R)");
    if (causal && a.q_lens && a.kv_lens)
      for (int64_t b = 0; b < a.B; ++b)
        if (a.q_lens[b] > a.kv_lens[b]) return py::none();
    if (o.size()) {
      py::gil_scoped_release release;
      decode_forward(a);
    }
    raise_if_interrupted();
    return o;
  }

  py::array k_, v_;
  Strides4 sk_, sv_;
  int type_ = 0;  // 0 float, 1 double, 2 fp16, 3 bf16 bits
};

// A plan's decode call (_dispatch.bound, functional._PLANS): a decode-only
// record's fields bound once, called with the arrays and the scale; the same
// DecodeCall as _core.decode with those fields, without parsing 18 arguments
// per call (run_plan calls it from C, bindings_plans.cpp).
struct BoundDecode {
  bool causal, top_left;
  int64_t window_left, window_right;
  py::object q_lens, kv_lens;

  void operator()(py::array q, py::object k, py::object v, py::array o, double scale) const {
    decode(DecodeCall{q, o, k, v, py::none(), scale, causal, top_left, window_left, window_right,
                      q_lens, kv_lens, py::none(), 0, py::none(), std::string(), py::none(), 0});
  }
};

PyTypeObject* bound_decode_type = nullptr;  // set by def_decode

// Quantise a float32 chunk into an int8 cache (KvQuantArgs, csrc/kv_quant.cpp).
void kv_quant_append_py(py::array k, py::array v, py::array k8, py::array v8, py::object k_scale,
                        py::object k_off, py::object v_scale, py::object v_off, py::object stage,
                        py::object stage_grp, py::object pos0, py::object count,
                        py::object first_before, py::object first_after) {
  if (!py::isinstance<py::array_t<float>>(k) || !py::isinstance<py::array_t<float>>(v))
    throw py::type_error("k and v must be float32");
  if (k.ndim() != 4 || v.ndim() != 4 || k8.ndim() != 4 || v8.ndim() != 4)
    throw py::value_error("k, v, k8, v8 must be 4-D");
  KvQuantArgs a;
  a.B = k8.shape(0);
  a.Hkv = k8.shape(1);
  a.R = k8.shape(2);
  a.d = k8.shape(3);
  a.dv = v8.shape(3);
  a.L = k.shape(2);
  if (k.shape(0) != a.B || k.shape(1) != a.Hkv || k.shape(3) != a.d || v.shape(0) != a.B ||
      v.shape(1) != a.Hkv || v.shape(2) != a.L || v.shape(3) != a.dv)
    throw py::value_error("k, v do not match the cache's (B, Hkv, ., d / dv)");
  auto sarr = py::cast<py::array>(stage);
  a.G = sarr.ndim() == 4 ? sarr.shape(2) : 0;
  if (a.G < 1 || a.G > 512 || a.R % a.G != 0)
    throw py::value_error("stage must be (B, Hkv, G, d) with 1 <= G <= 512 dividing R");
  a.k8 = exact_array<int8_t>(k8, "k8", {a.B, a.Hkv, a.R, a.d}, true);
  a.v8 = exact_array<int8_t>(v8, "v8", {a.B, a.Hkv, a.R, a.dv}, true);
  a.k_scale = exact_array<float>(k_scale, "k_scale", {a.B, a.Hkv, a.R / a.G, a.d}, true);
  a.k_off = exact_array<float>(k_off, "k_off", {a.B, a.Hkv, a.R / a.G, a.d}, true);
  a.v_scale = exact_array<float>(v_scale, "v_scale", {a.B, a.Hkv, a.R}, true);
  a.v_off = exact_array<float>(v_off, "v_off", {a.B, a.Hkv, a.R}, true);
  a.stage = exact_array<float>(stage, "stage", {a.B, a.Hkv, a.G, a.d}, true);
  a.stage_grp = exact_array<int64_t>(stage_grp, "stage_grp", {a.B}, true);
  a.pos0 = exact_array<int64_t>(pos0, "pos0", {a.B}, false);
  a.count = exact_array<int64_t>(count, "count", {a.B}, false);
  a.first_before = exact_array<int64_t>(first_before, "first_before", {a.B}, false);
  a.first_after = exact_array<int64_t>(first_after, "first_after", {a.B}, false);
  for (int64_t b = 0; b < a.B; ++b)
    if (a.count[b] < 0 || a.count[b] > a.L || a.count[b] > a.R || a.pos0[b] < 0 ||
        a.first_before[b] < 0 || a.first_before[b] > a.pos0[b] ||
        a.first_after[b] < a.first_before[b] || a.first_after[b] > a.pos0[b] + a.count[b] ||
        a.pos0[b] + a.count[b] - a.first_after[b] > a.R)
      throw py::value_error("inconsistent pos0 / count / first_before / first_after");
  a.sk = strides4(k, "k");
  a.sv = strides4(v, "v");
  a.k = static_cast<const float*>(k.data());
  a.v = static_cast<const float*>(v.data());
  a.num_threads = threads_for_call();
  try {
    py::gil_scoped_release release;
    kv_quant_append(a);
  } catch (const std::invalid_argument&) {
    throw py::value_error(
        "k or v holds inf or NaN: an int8 cache stores finite values only (nothing was stored)");
  }
}

}  // namespace

py::object ring_append_step(py::handle ring, const py::array& q, const py::array& k,
                            const py::array& v, py::handle scale, int64_t window_left,
                            const py::array& n, const py::array& start, const py::array& pos,
                            const py::array& last_new) {
  return ring.cast<DecodeRing&>().append_step(q, k, v, scale, window_left, n, start, pos, last_new);
}

bool call_bound_decode(py::handle run, py::handle q, py::handle k, py::handle v, py::handle o,
                       py::handle scale) {
  if (!bound_decode_type || Py_TYPE(run.ptr()) != bound_decode_type) return false;
  const double s = PyFloat_AsDouble(scale.ptr());
  if (s == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  run.cast<const BoundDecode&>()(
      py::reinterpret_borrow<py::array>(q), py::reinterpret_borrow<py::object>(k),
      py::reinterpret_borrow<py::object>(v), py::reinterpret_borrow<py::array>(o), s);
  return true;
}

void def_decode(py::module_& m) {
  m.def(
      "decode",
      [](py::array q, py::object k, py::object v, py::array o, py::object lse, double scale,
         bool causal, bool top_left, int64_t window_left, int64_t window_right, py::object q_lens,
         py::object kv_lens, py::object kv_start, int64_t split, py::object block_table,
         std::string encoding, py::object aux, int64_t group) {
        decode(DecodeCall{q, o, k, v, lse, scale, causal, top_left, window_left, window_right,
                          q_lens, kv_lens, kv_start, split, block_table, encoding, aux, group});
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse") = py::none(),
      py::arg("scale") = std::numeric_limits<double>::quiet_NaN(), py::arg("causal") = false,
      py::arg("top_left") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
      py::arg("q_lens") = py::none(), py::arg("kv_lens") = py::none(),
      py::arg("kv_start") = py::none(), py::arg("split") = 0, py::arg("block_table") = py::none(),
      py::arg("encoding") = "", py::arg("aux") = py::none(), py::arg("group") = 0,
      "Split-KV decode kernel (scale required: its NaN default is refused). k, v: 4-D strided "
      "arrays (B, Hkv, R, d / dv), a ring of R slots "
      "with kv_start; or, with block_table (B, max_blocks), lists of pool chunks (chunk_blocks, "
      "Hkv, block_size, d / dv) read in place. With encoding= (a coded encoding's name: "
      "'int8', ...; a wrong one lists them), k / v are its one-byte codes, aux its float32 side "
      "arrays in the encoding's order (a wrong count names them) and group its key group; each "
      "side array (B, Hkv, ...) or, for a pool, a "
      "list of (chunk_blocks, Hkv, ...) chunks.");
  py::class_<DecodeRing>(m, "DecodeRing",
                         "A KV cache's ring of slots k (B, Hkv, R, d), v (B, Hkv, R, dv) "
                         "bound once for decode calls; held, not copied.")
      .def(py::init<py::array, py::array>(), py::arg("k"), py::arg("v"))
      .def("__call__", &DecodeRing::call, py::arg("q"), py::arg("scale"), py::arg("causal"),
           py::arg("window_left"), py::arg("q_lens"), py::arg("kv_lens"), py::arg("kv_start"),
           "decode(q, k, v, o, None, scale, causal, False, window_left, -1, q_lens, kv_lens, "
           "kv_start) on a new o (B, Hq, Lq, dv) of q's dtype, which it returns; None (no "
           "kernel call) when causal and some q_lens[b] > kv_lens[b].");
  auto bound =
      py::class_<BoundDecode>(
          m, "BoundDecode",
          "decode(q, k, v, o, None, scale, causal, top_left, window_left, window_right, q_lens, "
          "kv_lens) with the record's fields bound once (a plan's kernel call).")
          .def(py::init([](bool causal, bool top_left, int64_t window_left, int64_t window_right,
                           py::object q_lens, py::object kv_lens) {
                 return BoundDecode{causal, top_left, window_left, window_right, q_lens, kv_lens};
               }),
               py::arg("causal"), py::arg("top_left"), py::arg("window_left"),
               py::arg("window_right"), py::arg("q_lens"), py::arg("kv_lens"))
          .def("__call__", &BoundDecode::operator(), py::arg("q"), py::arg("k"), py::arg("v"),
               py::arg("o"), py::arg("scale"));
  bound_decode_type = reinterpret_cast<PyTypeObject*>(bound.ptr());
  m.def("kv_quant_append", &kv_quant_append_py, py::arg("k"), py::arg("v"), py::arg("k8"),
        py::arg("v8"), py::arg("k_scale"), py::arg("k_off"), py::arg("v_scale"), py::arg("v_off"),
        py::arg("stage"), py::arg("stage_grp"), py::arg("pos0"), py::arg("count"),
        py::arg("first_before"), py::arg("first_after"),
        "Quantise float32 k, v chunks into an int8 KV cache (keys per channel and group, values "
        "per token); see KvQuantArgs.");
}

}  // namespace bindings
}  // namespace attn_fast
