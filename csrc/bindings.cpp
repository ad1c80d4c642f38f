// Thin pybind11 layer: take arrays, check only what would crash, release the
// GIL, call one entry point. Argument checking with user-facing messages,
// shapes and dispatch live in python/attn_fast/functional.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attn_fast/attention.h"
#include "attn_fast/interrupt.h"
#include "attn_fast/linear_attn.h"

namespace py = pybind11;
using namespace attn_fast;

namespace {

// Ctrl-C: the kernels' cancellation tokens call this on the thread that
// started the call, with the GIL released, every few tens of milliseconds
// (attn_fast/interrupt.h). It runs the Python signal handlers; when one
// raised (KeyboardInterrupt) the error stays set and the kernel stops.
bool python_signal_raised() {
  const PyGILState_STATE st = PyGILState_Ensure();
  const bool raised = PyErr_CheckSignals() != 0;
  PyGILState_Release(st);
  return raised;
}

// After a kernel returned, with the GIL held again: a signal handler that
// raised during the call (the kernel stopped early, its outputs are partly
// written) turns into that exception, so nothing is returned.
void raise_if_interrupted() {
  if (PyErr_Occurred()) throw py::error_already_set();
}

Strides4 strides4(const py::array& x, const char* name) {
  if (x.ndim() != 4) throw py::value_error(std::string(name) + " must be 4-D (B, H, L, d)");
  const auto item = static_cast<int64_t>(x.itemsize());
  int64_t s[4];
  for (int i = 0; i < 4; ++i) {
    const int64_t b = static_cast<int64_t>(x.strides(i));
    if (b % item != 0)
      throw py::value_error(std::string(name) +
                            " has strides that are not a multiple of its itemsize");
    s[i] = b / item;
  }
  if (reinterpret_cast<uintptr_t>(x.data()) % static_cast<uintptr_t>(item) != 0)
    throw py::value_error(std::string(name) + " is not aligned to its itemsize");
  return {s[0], s[1], s[2], s[3]};
}

std::string shape_of(const py::array& x) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < x.ndim(); ++i) s += (i ? ", " : "") + std::to_string(x.shape(i));
  return s + (x.ndim() == 1 ? ",)" : ")");
}

// A 4-D mask / bias / layout must have exactly the shape the kernel indexes
// (broadcast views have it too, with zero strides): anything smaller would be
// read out of bounds.
void check_shape4(const py::array& x, const char* name, int64_t b, int64_t h, int64_t l,
                  int64_t m) {
  if (x.shape(0) != b || x.shape(1) != h || x.shape(2) != l || x.shape(3) != m)
    throw py::value_error(std::string(name) + " has shape " + shape_of(x) + ", expected (" +
                          std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(l) +
                          ", " + std::to_string(m) + ")");
}

template <typename T>
const T* data_of(const py::object& obj, const char* name, int64_t n) {
  if (obj.is_none()) return nullptr;
  auto arr = py::cast<py::array>(obj);
  if (!py::isinstance<py::array_t<T>>(arr) || !(arr.flags() & py::array::c_style))
    throw py::type_error(std::string(name) + ": expected a C-contiguous array of the right dtype");
  if (reinterpret_cast<uintptr_t>(arr.data()) % alignof(T) != 0)
    throw py::value_error(std::string(name) + " is not aligned to its itemsize");
  if (n >= 0 && arr.size() != n)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(n) +
                          " elements, got shape " + shape_of(arr));
  return static_cast<const T*>(arr.data());
}

// varlen offsets: n + 1 entries, non-decreasing, within [0, total] (the kernel
// reads rows cu[s] .. cu[s+1] - 1 of the packed tensor).
void check_cu(const int64_t* cu, int64_t n, int64_t total, const char* name) {
  for (int64_t s = 0; s <= n; ++s)
    if (cu[s] < 0 || cu[s] > total || (s > 0 && cu[s] < cu[s - 1]))
      throw py::value_error(std::string(name) + " must be non-decreasing within [0, " +
                            std::to_string(total) + "], got " + std::to_string(cu[s]) +
                            " at index " + std::to_string(s));
}

// Window sides beyond any sequence mean "unbounded" anyway; clamping keeps the
// kernels' i + off +- window arithmetic far from int64 overflow.
int64_t clamp_window(int64_t w) { return w > (int64_t(1) << 62) ? (int64_t(1) << 62) : w; }

// q, k, v, o of storage type T: float32 / float64 arrays as themselves, fp16
// as NumPy float16, bf16 as its uint16 bit patterns (NumPy has no bfloat16;
// the Python layer views torch.bfloat16 / ml_dtypes.bfloat16 data as uint16).
template <typename T>
bool has_dtype(const py::array& x) {
  return py::isinstance<py::array_t<T>>(x);
}
template <>
bool has_dtype<bf16_t>(const py::array& x) {
  return py::isinstance<py::array_t<uint16_t>>(x);
}
template <>
bool has_dtype<fp16_t>(const py::array& x) {
  return x.dtype().kind() == 'f' && x.itemsize() == 2;
}

// What forward and decode share: q, k, v, o of one dtype T (o writeable),
// their strides and data, and the causal / window options. Shapes are
// checked by each caller (the key axis means Lk for one, ring slots for the
// other).
template <typename T, typename Args>
void bind_qkvo(Args& a, py::array& q, py::array& k, py::array& v, py::array& o, double scale,
               bool causal, bool top_left, int64_t window_left, int64_t window_right) {
  for (auto* arr : {&q, &k, &v, &o})
    if (!has_dtype<T>(*arr)) throw py::type_error("q, k, v, o must share one dtype");
  if (!o.writeable()) throw py::value_error("o is read-only");
  a.sq = strides4(q, "q");
  a.sk = strides4(k, "k");
  a.sv = strides4(v, "v");
  a.so = strides4(o, "o");
  a.q = static_cast<const T*>(q.data());
  a.k = static_cast<const T*>(k.data());
  a.v = static_cast<const T*>(v.data());
  a.o = static_cast<T*>(o.mutable_data());
  // A scale finite as a double but not in the compute type (1e300 with float32) would turn
  // every score into inf or NaN: refuse it (the Python layer says so first).
  if (!(std::fabs(scale) <= static_cast<double>(std::numeric_limits<compute_t<T>>::max())))
    throw py::value_error("scale = " + py::str(py::float_(scale)).cast<std::string>() +
                          " is out of the range of the inputs' dtype");
  a.scale = scale;
  a.causal = causal;
  a.top_left = top_left;
  a.window_left = clamp_window(window_left);
  a.window_right = clamp_window(window_right);
}

// The optional lse output: a writeable C-contiguous array of n elements of T.
template <typename T>
T* lse_of(const py::object& lse, int64_t n, const char* expected) {
  if (lse.is_none()) return nullptr;
  auto arr = py::cast<py::array>(lse);
  if (!py::isinstance<py::array_t<T>>(arr) || !(arr.flags() & py::array::c_style) ||
      !arr.writeable() || arr.size() != n)
    throw py::value_error(std::string("lse must be a writeable C-contiguous array of ") + expected +
                          " elements");
  return static_cast<T*>(arr.mutable_data());
}

// (B, Hq, Lq, d), (B, Hkv, Lk, d), (B, Hkv, Lk, dv), (B, Hq, Lq, dv): the sizes, checked.
template <typename T>
void bind_shapes(AttnArgs<T>& a, const py::array& q, const py::array& k, const py::array& v,
                 const py::array& o) {
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.Lq = q.shape(2);
  a.d = q.shape(3);
  a.Hkv = k.shape(1);
  a.Lk = k.shape(2);
  a.dv = v.shape(3);
  if (k.shape(3) != a.d || v.shape(2) != a.Lk || v.shape(1) != a.Hkv || k.shape(0) != v.shape(0) ||
      o.shape(0) != a.B || o.shape(1) != a.Hq || o.shape(2) != a.Lq || o.shape(3) != a.dv)
    throw py::value_error("inconsistent q/k/v/o shapes");
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0) throw py::value_error("Hq must be a multiple of Hkv");
}

// The length, mask and score arguments the forward and the backward share:
// varlen offsets (a.B becomes the number of sequences), per-batch lengths,
// ALiBi slopes, sinks, the block-sparse layout, the dense boolean mask and
// the additive bias, each checked against q's shape. The arrays stay alive
// through the caller's py::object arguments.
template <typename T>
void bind_mask_args(AttnArgs<T>& a, const py::array& q, const py::array& k, py::object q_lens,
                    py::object kv_lens, py::object cu_q, py::object cu_k, py::object layout,
                    int64_t layout_bq, int64_t layout_bk, py::object mask, py::object bias,
                    py::object alibi, double softcap, py::object sinks, int block_q, int block_k) {
  const bool varlen = !cu_q.is_none();
  if (!varlen && k.shape(0) != a.B) throw py::value_error("k batch differs from q batch");
  a.softcap = softcap;
  a.block_q = block_q;
  a.block_k = block_k;
  a.num_threads = threads_for_call();
  const int64_t batch_q = a.B;  // masks, biases and layouts are indexed by q's own batch axis
  if (varlen) {
    if (cu_k.is_none()) throw py::value_error("cu_seqlens_q needs cu_seqlens_k");
    auto cq = py::cast<py::array>(cu_q);
    const int64_t nseq = static_cast<int64_t>(cq.size()) - 1;
    if (nseq < 0) throw py::value_error("cu_seqlens_q is empty");
    a.cu_q = data_of<int64_t>(cu_q, "cu_seqlens_q", -1);
    a.cu_k = data_of<int64_t>(cu_k, "cu_seqlens_k", nseq + 1);
    if (a.B != 1 || k.shape(0) != 1)
      throw py::value_error("varlen q, k and v must have batch 1, got q " + shape_of(q) + ", k " +
                            shape_of(k));
    check_cu(a.cu_q, nseq, a.Lq, "cu_seqlens_q");
    check_cu(a.cu_k, nseq, a.Lk, "cu_seqlens_k");
    a.B = nseq;
  } else if (!cu_k.is_none()) {
    throw py::value_error("cu_seqlens_k needs cu_seqlens_q");
  }
  a.q_lens = data_of<int64_t>(q_lens, "q_lens", varlen ? -1 : a.B);
  a.kv_lens = data_of<int64_t>(kv_lens, "kv_lens", varlen ? -1 : a.B);
  using C = compute_t<T>;  // lse, bias, alibi, sinks: fp32 for 16-bit storage
  a.alibi = data_of<C>(alibi, "alibi_slopes", a.Hq);
  a.sinks = data_of<C>(sinks, "sinks", a.Hq);
  py::array layout_arr, mask_arr, bias_arr;
  if (!layout.is_none()) {
    layout_arr = py::cast<py::array>(layout);
    if (!py::isinstance<py::array_t<uint8_t>>(layout_arr))
      throw py::type_error("layout must be uint8");
    a.slayout = strides4(layout_arr, "layout");
    a.layout = static_cast<const uint8_t*>(layout_arr.data());
    a.layout_bq = layout_bq;
    a.layout_bk = layout_bk;
    a.layout_nq = layout_arr.shape(2);
    a.layout_nk = layout_arr.shape(3);
    if (layout_bq < 1 || layout_bk < 1)
      throw py::value_error("layout_bq and layout_bk must be >= 1");
    // ceil(L / block) blocks, written without L + block - 1 (no overflow for huge blocks)
    const int64_t nq = a.Lq / layout_bq + (a.Lq % layout_bq != 0);
    const int64_t nk = a.Lk / layout_bk + (a.Lk % layout_bk != 0);
    if (layout_arr.shape(0) != batch_q || layout_arr.shape(1) != a.Hq || a.layout_nq < nq ||
        a.layout_nk < nk)
      throw py::value_error("layout has shape " + shape_of(layout_arr) + ", expected (" +
                            std::to_string(batch_q) + ", " + std::to_string(a.Hq) +
                            ", >= " + std::to_string(nq) + ", >= " + std::to_string(nk) +
                            ") to cover (Lq, Lk) = (" + std::to_string(a.Lq) + ", " +
                            std::to_string(a.Lk) + ")");
  }
  if (!mask.is_none()) {
    mask_arr = py::cast<py::array>(mask);
    if (!py::isinstance<py::array_t<uint8_t>>(mask_arr)) throw py::type_error("mask must be uint8");
    a.smask = strides4(mask_arr, "mask");
    check_shape4(mask_arr, "mask", batch_q, a.Hq, a.Lq, a.Lk);
    a.mask = static_cast<const uint8_t*>(mask_arr.data());
  }
  if (!bias.is_none()) {
    bias_arr = py::cast<py::array>(bias);
    if (!py::isinstance<py::array_t<C>>(bias_arr))
      throw py::type_error("bias must have q's dtype (float32 for float16 / bfloat16 q)");
    a.sbias = strides4(bias_arr, "bias");
    check_shape4(bias_arr, "bias", batch_q, a.Hq, a.Lq, a.Lk);
    a.bias = static_cast<const C*>(bias_arr.data());
  }
}

template <typename T>
py::tuple forward_t(py::array q, py::array k, py::array v, py::array o, py::object lse,
                    double scale, bool causal, bool top_left, int64_t window_left,
                    int64_t window_right, py::object q_lens, py::object kv_lens, py::object cu_q,
                    py::object cu_k, py::object layout, int64_t layout_bq, int64_t layout_bk,
                    py::object mask, py::object bias, py::object alibi, double softcap,
                    py::object sinks, int block_q, int block_k, bool reference) {
  AttnArgs<T> a;
  bind_qkvo<T>(a, q, k, v, o, scale, causal, top_left, window_left, window_right);
  bind_shapes(a, q, k, v, o);
  bind_mask_args<T>(a, q, k, q_lens, kv_lens, cu_q, cu_k, layout, layout_bq, layout_bk, mask, bias,
                    alibi, softcap, sinks, block_q, block_k);
  using C = compute_t<T>;  // lse: fp32 for 16-bit storage
  const int64_t lse_rows = a.cu_q ? a.Lq : a.B * a.Lq;
  a.lse = lse_of<C>(lse, a.Hq * lse_rows, "Hq * rows");
  AttnStats st;
  {
    py::gil_scoped_release release;
    if (reference)
      reference_forward(a);
    else
      st = flash_forward(a);
  }
  raise_if_interrupted();
  return py::make_tuple(st.tiles_computed, st.tiles_skipped, st.block_q, st.block_k);
}

py::tuple forward(py::array q, py::array k, py::array v, py::array o, py::object lse, double scale,
                  bool causal, bool top_left, int64_t window_left, int64_t window_right,
                  py::object q_lens, py::object kv_lens, py::object cu_q, py::object cu_k,
                  py::object layout, int64_t layout_bq, int64_t layout_bk, py::object mask,
                  py::object bias, py::object alibi, double softcap, py::object sinks, int block_q,
                  int block_k, bool reference) {
  if (py::isinstance<py::array_t<float>>(q))
    return forward_t<float>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                            q_lens, kv_lens, cu_q, cu_k, layout, layout_bq, layout_bk, mask, bias,
                            alibi, softcap, sinks, block_q, block_k, reference);
  if (py::isinstance<py::array_t<double>>(q))
    return forward_t<double>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                             q_lens, kv_lens, cu_q, cu_k, layout, layout_bq, layout_bk, mask, bias,
                             alibi, softcap, sinks, block_q, block_k, reference);
  if (has_dtype<fp16_t>(q))
    return forward_t<fp16_t>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                             q_lens, kv_lens, cu_q, cu_k, layout, layout_bq, layout_bk, mask, bias,
                             alibi, softcap, sinks, block_q, block_k, reference);
  if (has_dtype<bf16_t>(q))
    return forward_t<bf16_t>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                             q_lens, kv_lens, cu_q, cu_k, layout, layout_bq, layout_bk, mask, bias,
                             alibi, softcap, sinks, block_q, block_k, reference);
  throw py::type_error("q must be float32, float64, float16 or bfloat16 (as uint16 bits)");
}

// T: v and o (float, double, bf16_t as uint16 bits, fp16_t); F: the features
// q, k (T itself, or float for the 16-bit T).
template <typename T, typename F = T>
void linear_t(py::array q, py::array k, py::array v, py::array o, py::object kv, py::object k_sum,
              bool causal, double eps) {
  LinearAttnArgs<T, F> a;
  for (auto* arr : {&q, &k})
    if (!py::isinstance<py::array_t<F>>(*arr))
      throw py::type_error(std::is_same<T, F>::value
                               ? "q, k, v, o must share one dtype"
                               : "q, k must be float32 features for 16-bit v, o");
  for (auto* arr : {&v, &o})
    if (!has_dtype<T>(*arr)) throw py::type_error("q, k, v, o must share one dtype");
  if (!o.writeable()) throw py::value_error("o is read-only");
  a.sq = strides4(q, "q");
  a.sk = strides4(k, "k");
  a.sv = strides4(v, "v");
  a.so = strides4(o, "o");
  a.B = q.shape(0);
  a.H = q.shape(1);
  a.L = q.shape(2);
  a.d = q.shape(3);
  a.dv = v.shape(3);
  for (int i = 0; i < 3; ++i)
    if (k.shape(i) != q.shape(i) || v.shape(i) != q.shape(i) || o.shape(i) != q.shape(i))
      throw py::value_error("q, k, v, o must agree on (B, H, L)");
  if (k.shape(3) != a.d || o.shape(3) != a.dv)
    throw py::value_error("inconsistent q/k/v/o head dims");
  a.q = static_cast<const F*>(q.data());
  a.k = static_cast<const F*>(k.data());
  a.v = static_cast<const T*>(v.data());
  a.o = static_cast<T*>(o.mutable_data());
  a.causal = causal;
  a.eps = eps;
  a.num_threads = threads_for_call();  // records the pool for the fork handler
  py::array kv_arr, z_arr;
  if (kv.is_none() != k_sum.is_none()) throw py::value_error("kv and k_sum go together");
  if (!kv.is_none()) {
    kv_arr = py::cast<py::array>(kv);
    z_arr = py::cast<py::array>(k_sum);
    for (auto* arr : {&kv_arr, &z_arr})
      if (!py::isinstance<py::array_t<double>>(*arr) || !(arr->flags() & py::array::c_style) ||
          !arr->writeable())
        throw py::type_error("kv and k_sum must be writeable C-contiguous float64 arrays");
    if (kv_arr.size() != a.B * a.H * a.d * a.dv || z_arr.size() != a.B * a.H * a.d)
      throw py::value_error("kv must have B*H*d*dv elements and k_sum B*H*d");
    a.kv = static_cast<double*>(kv_arr.mutable_data());
    a.k_sum = static_cast<double*>(z_arr.mutable_data());
  }
  {
    py::gil_scoped_release release;
    linear_attention_forward(a);
  }
  raise_if_interrupted();
}

void linear_attention(py::array q, py::array k, py::array v, py::array o, py::object kv,
                      py::object k_sum, bool causal, double eps) {
  if (py::isinstance<py::array_t<float>>(q) && has_dtype<fp16_t>(v))
    return linear_t<fp16_t, float>(q, k, v, o, kv, k_sum, causal, eps);
  if (py::isinstance<py::array_t<float>>(q) && has_dtype<bf16_t>(v))
    return linear_t<bf16_t, float>(q, k, v, o, kv, k_sum, causal, eps);
  if (py::isinstance<py::array_t<float>>(q))
    return linear_t<float>(q, k, v, o, kv, k_sum, causal, eps);
  if (py::isinstance<py::array_t<double>>(q))
    return linear_t<double>(q, k, v, o, kv, k_sum, causal, eps);
  throw py::type_error("q must be float32 or float64");
}

// The decode kernel's geometry from q (B, Hq, Lq, d), k (B, Hkv, R, d),
// v (B, Hkv, R, dv), o (B, Hq, Lq, dv): set in `a` and checked (ValueError).
template <typename T>
void bind_decode_shapes(DecodeArgs<T>& a, const py::array& q, const py::array& k,
                        const py::array& v, const py::array& o) {
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.Lq = q.shape(2);
  a.d = q.shape(3);
  a.Hkv = k.shape(1);
  a.R = k.shape(2);
  a.dv = v.shape(3);
  if (k.shape(0) != a.B || v.shape(0) != a.B || k.shape(3) != a.d || v.shape(2) != a.R ||
      v.shape(1) != a.Hkv || o.shape(0) != a.B || o.shape(1) != a.Hq || o.shape(2) != a.Lq ||
      o.shape(3) != a.dv)
    throw py::value_error("inconsistent q/k/v/o shapes");
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0) throw py::value_error("Hq must be a multiple of Hkv");
}

// The rest of a decode call (lengths, ring starts, split, lse), then the
// kernel with the GIL released.
template <typename T>
void run_decode(DecodeArgs<T>& a, py::object lse, py::object q_lens, py::object kv_lens,
                py::object kv_start, int64_t split) {
  a.split = split > a.R
                ? a.R
                : split;  // a split longer than the keys is one split (no c0 + split overflow)
  a.num_threads = threads_for_call();  // 1 in a forked child of a libgomp process, as for forward
  a.q_lens = data_of<int64_t>(q_lens, "q_lens", a.B);
  a.kv_lens = data_of<int64_t>(kv_lens, "kv_lens", a.B);
  a.kv_start = data_of<int64_t>(kv_start, "kv_start", a.B);
  if (a.kv_start)
    for (int64_t b = 0; b < a.B; ++b)
      if (a.kv_start[b] < 0 || a.kv_start[b] >= (a.R > 0 ? a.R : 1))
        throw py::value_error("kv_start entries must lie in [0, R)");
  a.lse = lse_of<compute_t<T>>(lse, a.B * a.Hq * a.Lq, "B * Hq * Lq");
  {
    py::gil_scoped_release release;
    decode_forward(a);
  }
  raise_if_interrupted();
}

template <typename T>
void decode_t(py::array q, py::array k, py::array v, py::array o, py::object lse, double scale,
              bool causal, bool top_left, int64_t window_left, int64_t window_right,
              py::object q_lens, py::object kv_lens, py::object kv_start, int64_t split) {
  DecodeArgs<T> a;
  bind_qkvo<T>(a, q, k, v, o, scale, causal, top_left, window_left, window_right);
  bind_decode_shapes(a, q, k, v, o);
  run_decode(a, lse, q_lens, kv_lens, kv_start, split);
}

// A C-contiguous writeable (or readable) array of `dtype` with this shape, or a ValueError naming
// it.
template <typename T>
T* exact_array(const py::object& obj, const char* name, std::initializer_list<int64_t> shape,
               bool write) {
  if (obj.is_none()) throw py::value_error(std::string(name) + " is required for an int8 cache");
  auto arr = py::cast<py::array>(obj);
  bool ok = py::isinstance<py::array_t<T>>(arr) && (arr.flags() & py::array::c_style) &&
            arr.ndim() == static_cast<py::ssize_t>(shape.size()) && (!write || arr.writeable());
  int i = 0;
  for (int64_t n : shape) ok = ok && arr.shape(i++) == n;
  if (!ok) {
    std::string s = "(";
    for (int64_t n : shape) s += std::to_string(n) + ", ";
    throw py::value_error(std::string(name) + " must be a C-contiguous " +
                          (write ? "writeable " : "") + "array of shape " +
                          s.substr(0, s.size() - 2) + ") of its dtype");
  }
  return static_cast<T*>(write ? arr.mutable_data() : const_cast<void*>(arr.data()));
}

// Decode over an int8 KV cache (DecodeArgs<float>::k8): q, o float32; k, v
// int8 (B, Hkv, R, d) / (B, Hkv, R, dv) with element stride 1; the scales
// and offsets contiguous float32 (B, Hkv, R / kgroup, d) and (B, Hkv, R).
void decode_q8(py::array q, py::array k, py::array v, py::array o, py::object lse, double scale,
               bool causal, bool top_left, int64_t window_left, int64_t window_right,
               py::object q_lens, py::object kv_lens, py::object kv_start, int64_t split,
               py::object k_scale, py::object k_off, py::object v_scale, py::object v_off,
               int64_t kgroup) {
  if (!py::isinstance<py::array_t<float>>(q) || !py::isinstance<py::array_t<float>>(o) ||
      !py::isinstance<py::array_t<int8_t>>(v))
    throw py::type_error("an int8 cache takes float32 q and o, int8 k and v");
  if (!o.writeable()) throw py::value_error("o is read-only");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || o.ndim() != 4)
    throw py::value_error("q, k, v, o must be 4-D");
  DecodeArgs<float> a;
  a.sq = strides4(q, "q");
  a.sk = strides4(k, "k");
  a.sv = strides4(v, "v");
  a.so = strides4(o, "o");
  if (a.sk.d != 1 || a.sv.d != 1)
    throw py::value_error("int8 k and v need element stride 1 along d");
  a.q = static_cast<const float*>(q.data());
  a.o = static_cast<float*>(o.mutable_data());
  a.k8 = static_cast<const int8_t*>(k.data());
  a.v8 = static_cast<const int8_t*>(v.data());
  if (!(std::fabs(scale) <= static_cast<double>(std::numeric_limits<float>::max())))
    throw py::value_error("scale is out of the range of float32");
  a.scale = scale;
  a.causal = causal;
  a.top_left = top_left;
  a.window_left = clamp_window(window_left);
  a.window_right = clamp_window(window_right);
  bind_decode_shapes(a, q, k, v, o);
  if (kgroup < 1 || a.R % kgroup != 0)
    throw py::value_error("kgroup must be >= 1 and divide the slots R");
  a.kgroup = kgroup;
  a.k_scale = exact_array<float>(k_scale, "k_scale", {a.B, a.Hkv, a.R / kgroup, a.d}, false);
  a.k_off = exact_array<float>(k_off, "k_off", {a.B, a.Hkv, a.R / kgroup, a.d}, false);
  a.v_scale = exact_array<float>(v_scale, "v_scale", {a.B, a.Hkv, a.R}, false);
  a.v_off = exact_array<float>(v_off, "v_off", {a.B, a.Hkv, a.R}, false);
  run_decode(a, lse, q_lens, kv_lens, kv_start, split);
}

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

void decode(py::array q, py::array k, py::array v, py::array o, py::object lse, double scale,
            bool causal, bool top_left, int64_t window_left, int64_t window_right,
            py::object q_lens, py::object kv_lens, py::object kv_start, int64_t split,
            py::object k_scale, py::object k_off, py::object v_scale, py::object v_off,
            int64_t kgroup) {
  if (py::isinstance<py::array_t<int8_t>>(k))
    return decode_q8(q, k, v, o, lse, scale, causal, top_left, window_left, window_right, q_lens,
                     kv_lens, kv_start, split, k_scale, k_off, v_scale, v_off, kgroup);
  if (py::isinstance<py::array_t<float>>(q))
    return decode_t<float>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                           q_lens, kv_lens, kv_start, split);
  if (py::isinstance<py::array_t<double>>(q))
    return decode_t<double>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                            q_lens, kv_lens, kv_start, split);
  if (has_dtype<fp16_t>(q))
    return decode_t<fp16_t>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                            q_lens, kv_lens, kv_start, split);
  if (has_dtype<bf16_t>(q))
    return decode_t<bf16_t>(q, k, v, o, lse, scale, causal, top_left, window_left, window_right,
                            q_lens, kv_lens, kv_start, split);
  throw py::type_error("q must be float32, float64, float16 or bfloat16 (as uint16 bits)");
}

// Decode over a paged KV cache (DecodeArgs::block_table, PagedKVCache):
// q (B, Hq, Lq, d) and o (B, Hq, Lq, dv) of storage type T; k_chunks /
// v_chunks lists of pool chunks (chunk_blocks, Hkv, block_size, d / dv), one
// shape and one set of strides each; block_table C-contiguous int64
// (B, max_blocks); kv_lens (B,) required, each <= max_blocks * block_size, and
// the first ceil(kv_lens[b] / block_size) entries of row b name blocks of the
// pool. Everything the kernel would read out of bounds is checked here.
template <typename T>
std::vector<const T*> pool_chunks(const py::list& chunks, const char* name, int64_t dim,
                                  const py::array& like, Strides4* st) {
  std::vector<const T*> out;
  for (py::ssize_t c = 0; c < static_cast<py::ssize_t>(chunks.size()); ++c) {
    auto x = py::cast<py::array>(chunks[c]);
    if (!has_dtype<T>(x)) throw py::type_error(std::string(name) + " chunks must have q's dtype");
    if (x.ndim() != 4) throw py::value_error(std::string(name) + " chunks must be 4-D");
    const Strides4 s = strides4(x, name);
    if (c == 0) {
      *st = s;
    } else if (s.b != st->b || s.h != st->h || s.l != st->l || s.d != st->d) {
      throw py::value_error(std::string(name) + " chunks must share one set of strides");
    }
    const py::array& ref = like;  // chunk 0 of k: (chunk_blocks, Hkv, block_size)
    if (x.shape(0) != ref.shape(0) || x.shape(1) != ref.shape(1) || x.shape(2) != ref.shape(2) ||
        x.shape(3) != dim)
      throw py::value_error(std::string(name) + " chunk " + std::to_string(c) + " has shape " +
                            shape_of(x) + ", expected (" + std::to_string(ref.shape(0)) + ", " +
                            std::to_string(ref.shape(1)) + ", " + std::to_string(ref.shape(2)) +
                            ", " + std::to_string(dim) + ")");
    out.push_back(static_cast<const T*>(x.data()));
  }
  return out;
}

// The scale / offset chunks of a paged int8 pool: one C-contiguous float32 array per chunk of
// this shape.
std::vector<const float*> scale_chunks(const py::object& lst, const char* name, size_t n,
                                       std::initializer_list<int64_t> shape) {
  if (lst.is_none()) throw py::value_error(std::string(name) + " is required for an int8 pool");
  auto l = py::cast<py::list>(lst);
  if (l.size() != n)
    throw py::value_error(std::string(name) + " must hold one array per pool chunk");
  std::vector<const float*> out;
  for (auto item : l)
    out.push_back(exact_array<float>(py::reinterpret_borrow<py::object>(item), name, shape, false));
  return out;
}

// KV: T, or int8_t for an int8 pool (T = float; the scales in k_scale .. v_off, lists of
// chunks, see DecodeArgs::k8_chunks).
template <typename T, typename KV = T>
void decode_paged_t(py::array q, py::list k_chunks, py::list v_chunks, py::array o, py::object lse,
                    py::array block_table, py::object kv_lens, double scale, bool causal,
                    bool top_left, int64_t window_left, int64_t window_right, py::object q_lens,
                    int64_t split, py::object k_scale = py::none(), py::object k_off = py::none(),
                    py::object v_scale = py::none(), py::object v_off = py::none(),
                    int64_t kgroup = 0) {
  constexpr bool Q8 = std::is_same<KV, int8_t>::value;
  if (!has_dtype<T>(o)) throw py::type_error("q and o must share one dtype");
  if (!o.writeable()) throw py::value_error("o is read-only");
  if (q.ndim() != 4 || o.ndim() != 4) throw py::value_error("q and o must be 4-D");
  if (k_chunks.size() == 0 || k_chunks.size() != v_chunks.size())
    throw py::value_error("k_chunks and v_chunks must be non-empty lists of one length");
  DecodeArgs<T> a;
  a.sq = strides4(q, "q");
  a.so = strides4(o, "o");
  a.q = static_cast<const T*>(q.data());
  a.o = static_cast<T*>(o.mutable_data());
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.Lq = q.shape(2);
  a.d = q.shape(3);
  const auto k0 = py::cast<py::array>(k_chunks[0]);
  const auto v0 = py::cast<py::array>(v_chunks[0]);
  const std::vector<const KV*> kc = pool_chunks<KV>(k_chunks, "k", a.d, k0, &a.sk);
  if (v0.ndim() != 4) throw py::value_error("v chunks must be 4-D");
  a.dv = v0.shape(3);
  const std::vector<const KV*> vc = pool_chunks<KV>(v_chunks, "v", a.dv, k0, &a.sv);
  a.chunk_blocks = k0.shape(0);
  a.Hkv = k0.shape(1);
  a.block_size = k0.shape(2);
  if (a.chunk_blocks < 1 || a.block_size < 1) throw py::value_error("empty pool chunks");
  if (o.shape(0) != a.B || o.shape(1) != a.Hq || o.shape(2) != a.Lq || o.shape(3) != a.dv)
    throw py::value_error("o has shape " + shape_of(o) + ", expected (B, Hq, Lq, dv) of q " +
                          shape_of(q) + " and the pool's dv");
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0) throw py::value_error("Hq must be a multiple of Hkv");
  if (!py::isinstance<py::array_t<int64_t>>(block_table) ||
      !(block_table.flags() & py::array::c_style) || block_table.ndim() != 2 ||
      block_table.shape(0) != a.B)
    throw py::value_error("block_table must be a C-contiguous int64 array (B, max_blocks), got " +
                          shape_of(block_table));
  a.max_blocks = block_table.shape(1);
  a.R = a.max_blocks * a.block_size;
  a.block_table = static_cast<const int64_t*>(block_table.data());
  if (kv_lens.is_none()) throw py::value_error("kv_lens is required for a paged cache");
  const int64_t* kl = data_of<int64_t>(kv_lens, "kv_lens", a.B);
  const int64_t n_blocks = static_cast<int64_t>(kc.size()) * a.chunk_blocks;
  for (int64_t b = 0; b < a.B; ++b) {
    if (kl[b] < 0 || kl[b] > a.R)
      throw py::value_error("kv_lens[" + std::to_string(b) + "] = " + std::to_string(kl[b]) +
                            " is outside [0, max_blocks * block_size = " + std::to_string(a.R) +
                            "]");
    for (int64_t p = 0; p < (kl[b] + a.block_size - 1) / a.block_size; ++p) {
      const int64_t g = a.block_table[b * a.max_blocks + p];
      if (g < 0 || g >= n_blocks)
        throw py::value_error("block_table[" + std::to_string(b) + ", " + std::to_string(p) +
                              "] = " + std::to_string(g) + " is not a block of the pool of " +
                              std::to_string(n_blocks));
    }
  }
  std::vector<const float*> ks, ko, vs, vo;
  if constexpr (Q8) {
    if (a.sk.d != 1 || a.sv.d != 1)
      throw py::value_error("int8 k and v chunks need element stride 1 along d");
    if (kgroup < 1 || a.block_size % kgroup != 0)
      throw py::value_error("kgroup must be >= 1 and divide the block size");
    a.kgroup = kgroup;
    const int64_t C = a.chunk_blocks, ng = a.block_size / kgroup;
    ks = scale_chunks(k_scale, "k_scale", kc.size(), {C, a.Hkv, ng, a.d});
    ko = scale_chunks(k_off, "k_off", kc.size(), {C, a.Hkv, ng, a.d});
    vs = scale_chunks(v_scale, "v_scale", kc.size(), {C, a.Hkv, a.block_size});
    vo = scale_chunks(v_off, "v_off", kc.size(), {C, a.Hkv, a.block_size});
    a.k8_chunks = kc.data();
    a.v8_chunks = vc.data();
    a.ks_chunks = ks.data();
    a.ko_chunks = ko.data();
    a.vs_chunks = vs.data();
    a.vo_chunks = vo.data();
  } else {
    a.k_chunks = kc.data();
    a.v_chunks = vc.data();
  }
  if (!(std::fabs(scale) <= static_cast<double>(std::numeric_limits<compute_t<T>>::max())))
    throw py::value_error("scale is out of the range of the inputs' dtype");
  a.scale = scale;
  a.causal = causal;
  a.top_left = top_left;
  a.window_left = clamp_window(window_left);
  a.window_right = clamp_window(window_right);
  run_decode(a, lse, q_lens, kv_lens, py::none(), split);
}

void decode_paged(py::array q, py::list k_chunks, py::list v_chunks, py::array o, py::object lse,
                  py::array block_table, py::object kv_lens, double scale, bool causal,
                  bool top_left, int64_t window_left, int64_t window_right, py::object q_lens,
                  int64_t split, py::object k_scale, py::object k_off, py::object v_scale,
                  py::object v_off, int64_t kgroup) {
  if (k_chunks.size() > 0 && py::isinstance<py::array_t<int8_t>>(k_chunks[0])) {
    if (!py::isinstance<py::array_t<float>>(q))
      throw py::type_error("an int8 pool takes float32 q and o");
    return decode_paged_t<float, int8_t>(q, k_chunks, v_chunks, o, lse, block_table, kv_lens, scale,
                                         causal, top_left, window_left, window_right, q_lens, split,
                                         k_scale, k_off, v_scale, v_off, kgroup);
  }
  if (py::isinstance<py::array_t<float>>(q))
    return decode_paged_t<float>(q, k_chunks, v_chunks, o, lse, block_table, kv_lens, scale, causal,
                                 top_left, window_left, window_right, q_lens, split);
  if (py::isinstance<py::array_t<double>>(q))
    return decode_paged_t<double>(q, k_chunks, v_chunks, o, lse, block_table, kv_lens, scale,
                                  causal, top_left, window_left, window_right, q_lens, split);
  if (has_dtype<fp16_t>(q))
    return decode_paged_t<fp16_t>(q, k_chunks, v_chunks, o, lse, block_table, kv_lens, scale,
                                  causal, top_left, window_left, window_right, q_lens, split);
  if (has_dtype<bf16_t>(q))
    return decode_paged_t<bf16_t>(q, k_chunks, v_chunks, o, lse, block_table, kv_lens, scale,
                                  causal, top_left, window_left, window_right, q_lens, split);
  throw py::type_error("q must be float32, float64, float16 or bfloat16 (as uint16 bits)");
}

// The backward's gradient outputs: writeable arrays of T with the shape of
// their input (4-D strided).
template <typename T>
Strides4 grad_out(py::array& x, const py::array& like, const char* name) {
  if (!has_dtype<T>(x)) throw py::type_error(std::string(name) + " must have q's dtype");
  if (!x.writeable()) throw py::value_error(std::string(name) + " is read-only");
  if (x.ndim() != 4 || like.ndim() != 4 || x.shape(0) != like.shape(0) ||
      x.shape(1) != like.shape(1) || x.shape(2) != like.shape(2) || x.shape(3) != like.shape(3))
    throw py::value_error(std::string(name) + " has shape " + shape_of(x) + ", expected " +
                          shape_of(like));
  return strides4(x, name);
}

template <typename T>
void backward_t(py::array dout, py::array q, py::array k, py::array v, py::array o, py::array lse,
                py::array dq, py::array dk, py::array dv, py::object dsinks, double scale,
                bool causal, bool top_left, int64_t window_left, int64_t window_right,
                py::object q_lens, py::object kv_lens, py::object cu_q, py::object cu_k,
                py::object layout, int64_t layout_bq, int64_t layout_bk, py::object mask,
                py::object bias, py::object alibi, double softcap, py::object sinks, int block_q,
                int block_k) {
  BwdArgs<T> g;
  AttnArgs<T>& a = g.f;
  bind_qkvo<T>(a, q, k, v, o, scale, causal, top_left, window_left, window_right);
  bind_shapes(a, q, k, v, o);
  if (!has_dtype<T>(dout)) throw py::type_error("dout must have q's dtype");
  g.sdo = strides4(dout, "dout");
  if (dout.shape(0) != a.B || dout.shape(1) != a.Hq || dout.shape(2) != a.Lq ||
      dout.shape(3) != a.dv)
    throw py::value_error("dout has shape " + shape_of(dout) + ", expected the shape of o " +
                          shape_of(o));
  g.dout = static_cast<const T*>(dout.data());
  g.sdq = grad_out<T>(dq, q, "dq");
  g.sdk = grad_out<T>(dk, k, "dk");
  g.sdv = grad_out<T>(dv, v, "dv");
  g.dq = static_cast<T*>(dq.mutable_data());
  g.dk = static_cast<T*>(dk.mutable_data());
  g.dv = static_cast<T*>(dv.mutable_data());
  bind_mask_args<T>(a, q, k, q_lens, kv_lens, cu_q, cu_k, layout, layout_bq, layout_bk, mask, bias,
                    alibi, softcap, sinks, block_q, block_k);
  using C = compute_t<T>;  // lse, dsinks: fp32 for 16-bit storage
  const int64_t lse_rows = a.cu_q ? a.Lq : a.B * a.Lq;
  a.lse = const_cast<C*>(data_of<C>(lse, "lse", a.Hq * lse_rows));  // read only
  if (!dsinks.is_none()) {
    auto ds = py::cast<py::array>(dsinks);
    if (!py::isinstance<py::array_t<C>>(ds) || !(ds.flags() & py::array::c_style) ||
        !ds.writeable() || ds.size() != a.Hq)
      throw py::value_error(
          "dsinks must be a writeable C-contiguous array of Hq elements of q's dtype (float32 "
          "for float16 / bfloat16 q)");
    g.dsinks = static_cast<C*>(ds.mutable_data());
  }
  if (a.sinks && !g.dsinks) throw py::value_error("sinks need a dsinks output");
  {
    py::gil_scoped_release release;
    flash_backward(g);
  }
  raise_if_interrupted();
}

void backward(py::array dout, py::array q, py::array k, py::array v, py::array o, py::array lse,
              py::array dq, py::array dk, py::array dv, py::object dsinks, double scale,
              bool causal, bool top_left, int64_t window_left, int64_t window_right,
              py::object q_lens, py::object kv_lens, py::object cu_q, py::object cu_k,
              py::object layout, int64_t layout_bq, int64_t layout_bk, py::object mask,
              py::object bias, py::object alibi, double softcap, py::object sinks, int block_q,
              int block_k) {
  if (py::isinstance<py::array_t<float>>(q))
    return backward_t<float>(dout, q, k, v, o, lse, dq, dk, dv, dsinks, scale, causal, top_left,
                             window_left, window_right, q_lens, kv_lens, cu_q, cu_k, layout,
                             layout_bq, layout_bk, mask, bias, alibi, softcap, sinks, block_q,
                             block_k);
  if (py::isinstance<py::array_t<double>>(q))
    return backward_t<double>(dout, q, k, v, o, lse, dq, dk, dv, dsinks, scale, causal, top_left,
                              window_left, window_right, q_lens, kv_lens, cu_q, cu_k, layout,
                              layout_bq, layout_bk, mask, bias, alibi, softcap, sinks, block_q,
                              block_k);
  if (has_dtype<fp16_t>(q))
    return backward_t<fp16_t>(dout, q, k, v, o, lse, dq, dk, dv, dsinks, scale, causal, top_left,
                              window_left, window_right, q_lens, kv_lens, cu_q, cu_k, layout,
                              layout_bq, layout_bk, mask, bias, alibi, softcap, sinks, block_q,
                              block_k);
  if (has_dtype<bf16_t>(q))
    return backward_t<bf16_t>(dout, q, k, v, o, lse, dq, dk, dv, dsinks, scale, causal, top_left,
                              window_left, window_right, q_lens, kv_lens, cu_q, cu_k, layout,
                              layout_bq, layout_bk, mask, bias, alibi, softcap, sinks, block_q,
                              block_k);
  throw py::type_error("q must be float32, float64, float16 or bfloat16 (as uint16 bits)");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "attn_fast C++ core: fused flash-attention forward kernels (internal; use attn_fast)";
  set_interrupt_check(&python_signal_raised);  // Ctrl-C stops long kernel calls
  // Tile classes (attention.h TileClass), the numbering of masks.block_summary.
  m.attr("BLOCK_MASKED") = static_cast<int>(TileClass::masked);
  m.attr("BLOCK_PARTIAL") = static_cast<int>(TileClass::partial);
  m.attr("BLOCK_VISIBLE") = static_cast<int>(TileClass::visible);
  m.def("forward", &forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse") = py::none(), py::kw_only(), py::arg("scale"), py::arg("causal") = false,
        py::arg("top_left") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("q_lens") = py::none(), py::arg("kv_lens") = py::none(),
        py::arg("cu_q") = py::none(), py::arg("cu_k") = py::none(), py::arg("layout") = py::none(),
        py::arg("layout_bq") = 1, py::arg("layout_bk") = 1, py::arg("mask") = py::none(),
        py::arg("bias") = py::none(), py::arg("alibi") = py::none(), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("block_q") = 0, py::arg("block_k") = 0,
        py::arg("reference") = false,
        "Fused attention forward on 4-D strided arrays; returns (tiles_computed, tiles_skipped). "
        "float16 q/k/v/o are fp16; uint16 ones hold bfloat16 bits; lse, bias, alibi and sinks are "
        "float32 for both.");
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); });
  m.def("set_isa", [](const std::string& name) { set_active_isa(parse_isa(name)); });
  m.def(
      "set_decode_prefetch",
      [](const std::string& name) {
        if (name == "auto")
          set_decode_prefetch(DecodePrefetch::auto_);
        else if (name == "l1")
          set_decode_prefetch(DecodePrefetch::l1);
        else if (name == "l2")
          set_decode_prefetch(DecodePrefetch::l2);
        else
          throw std::invalid_argument("decode prefetch must be 'auto', 'l1' or 'l2', got '" + name +
                                      "'");
      },
      py::arg("name"));
  m.def("decode_prefetch",
        [] { return std::string(decode_prefetch() == DecodePrefetch::l2 ? "l2" : "l1"); });
  m.def("cpu_signature", [] {
    const CpuSignature s = cpu_signature();
    return py::make_tuple(s.vendor, s.family, s.model);
  });
  m.def("available_isas", [] {
    py::list out;
    for (Isa i : available_isas()) out.append(isa_name(i));
    return out;
  });
  m.def("compiled_isas", [] {
    py::list out;
    for (Isa i : compiled_isas()) out.append(isa_name(i));
    return out;
  });
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("get_num_threads", &get_num_threads);
  m.def("openmp_enabled", &openmp_enabled);
  m.def("openmp_runtime", &openmp_runtime);
  m.def(
      "forked_child_serial", &forked_child_serial,
      "True in a forked child of a libgomp process that ran threads: kernels run single-threaded.");
  m.def("threads_for_call", &threads_for_call,
        "Threads for one parallel call (get_num_threads(), 1 in a serial forked child); notes a "
        "pool for the fork guard.");
  m.def(
      "fma_peak_gflops",
      [](int threads, double seconds) {
        py::gil_scoped_release release;
        return fma_peak_gflops(threads, seconds);
      },
      py::arg("threads"), py::arg("seconds") = 0.3);
  m.def("linear_attention", &linear_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("o"), py::arg("kv") = py::none(), py::arg("k_sum") = py::none(), py::kw_only(),
        py::arg("causal") = false, py::arg("eps") = 0.0,
        "Linear attention on feature-mapped 4-D strided q, k (and v) into o; "
        "kv (B,H,d,dv) / k_sum (B,H,d) float64: optional running state, updated in place. "
        "q, k, v, o float32 or float64; or float32 q, k with 16-bit v, o (float16, or "
        "bfloat16 as uint16 bits).");
  m.def("decode", &decode, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse") = py::none(), py::kw_only(), py::arg("scale"), py::arg("causal") = false,
        py::arg("top_left") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("q_lens") = py::none(), py::arg("kv_lens") = py::none(),
        py::arg("kv_start") = py::none(), py::arg("split") = 0, py::arg("k_scale") = py::none(),
        py::arg("k_off") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("v_off") = py::none(), py::arg("kgroup") = 0,
        "Split-KV decode kernel on 4-D strided arrays; k/v may be a ring of R slots (kv_start); "
        "int8 k/v (with k_scale, k_off, v_scale, v_off, kgroup) read an int8 KV cache.");
  m.def("decode_paged", &decode_paged, py::arg("q"), py::arg("k_chunks"), py::arg("v_chunks"),
        py::arg("o"), py::arg("lse") = py::none(), py::kw_only(), py::arg("block_table"),
        py::arg("kv_lens"), py::arg("scale"), py::arg("causal") = false,
        py::arg("top_left") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("q_lens") = py::none(), py::arg("split") = 0, py::arg("k_scale") = py::none(),
        py::arg("k_off") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("v_off") = py::none(), py::arg("kgroup") = 0,
        "Split-KV decode kernel over a paged KV cache: K/V rows read in place through "
        "block_table (B, max_blocks) from the pool chunks (chunk_blocks, Hkv, block_size, d); "
        "int8 chunks with lists of scale / offset chunks (k_scale .. v_off, kgroup).");
  m.def("kv_quant_append", &kv_quant_append_py, py::arg("k"), py::arg("v"), py::arg("k8"),
        py::arg("v8"), py::arg("k_scale"), py::arg("k_off"), py::arg("v_scale"), py::arg("v_off"),
        py::arg("stage"), py::arg("stage_grp"), py::arg("pos0"), py::arg("count"),
        py::arg("first_before"), py::arg("first_after"),
        "Quantise float32 k, v chunks into an int8 KV cache (keys per channel and group, values "
        "per token); see KvQuantArgs.");
  m.def(
      "stream_read_gbps",
      [](int threads, int64_t nbytes, int reps) {
        py::gil_scoped_release release;
        return stream_read_gbps(threads, nbytes, reps);
      },
      py::arg("threads"), py::arg("nbytes"), py::arg("reps") = 5,
      "Streaming-read bandwidth (GB/s) of `threads` threads over an nbytes buffer, best of reps.");
  m.def(
      "read_bandwidth_gbs",
      [](int threads, int64_t bytes, double seconds) {
        py::gil_scoped_release release;
        return read_bandwidth_gbs(threads, bytes, seconds);
      },
      py::arg("threads"), py::arg("bytes") = int64_t(512) << 20, py::arg("seconds") = 0.3,
      "Streaming-read bandwidth in GB/s (best pass over a `bytes` buffer).");
  m.def("backward", &backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("o"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("dsinks") = py::none(), py::kw_only(), py::arg("scale"), py::arg("causal") = false,
        py::arg("top_left") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("q_lens") = py::none(), py::arg("kv_lens") = py::none(),
        py::arg("cu_q") = py::none(), py::arg("cu_k") = py::none(), py::arg("layout") = py::none(),
        py::arg("layout_bq") = 1, py::arg("layout_bk") = 1, py::arg("mask") = py::none(),
        py::arg("bias") = py::none(), py::arg("alibi") = py::none(), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("block_q") = 0, py::arg("block_k") = 0,
        "Fused FlashAttention-2 backward on 4-D strided arrays: writes dq, dk, dv (and dsinks). "
        "float16 arrays are fp16, uint16 ones bfloat16 bits (dq, dk, dv, dout, o of q's dtype); "
        "lse, bias, alibi, sinks and dsinks are float32 for them.");
  // AMX (issue 19): the status line of show_config(), the self-check and one
  // tile product of the amx / amx_emu objects (tests).
  m.def("amx_status", &amx_status, "Why amx is or is not the default ISA here (one line).");
  m.def(
      "amx_self_check",
      [](const std::string& name) {
        std::string why;
        bool ok;
        {
          py::gil_scoped_release release;
          ok = amx_self_check(parse_isa(name), &why);
        }
        return py::make_tuple(ok, why);
      },
      py::arg("isa"), "Run the tile path's self-check on ISA amx or amx_emu: (passed, line).");
  m.def(
      "tdpbf16ps_tile",
      [](const std::string& name, const py::array& a, const py::array& b, py::array c) {
        // Exact dtypes and C order (no converting copy: c is updated in place).
        auto ok = [](const py::array& x, bool f32, int64_t n) {
          const bool dt = f32 ? py::isinstance<py::array_t<float>>(x)
                              : py::isinstance<py::array_t<uint16_t>>(x);
          return dt && x.ndim() == 2 && x.shape(0) == 16 && x.shape(1) == n &&
                 (x.flags() & py::array::c_style);
        };
        if (!ok(a, false, 32) || !ok(b, false, 32) || !ok(c, true, 16))
          throw py::value_error(
              "tdpbf16ps_tile: a and b must be (16, 32) uint16 (bf16 bits; b in VNNI pairs), "
              "c (16, 16) float32, all C-contiguous");
        if (!c.writeable()) throw py::value_error("tdpbf16ps_tile: c must be writeable");
        const Isa isa = parse_isa(name);
        const uint16_t* pa = static_cast<const uint16_t*>(a.data());
        const uint16_t* pb = static_cast<const uint16_t*>(b.data());
        float* pc = static_cast<float*>(c.mutable_data());
        py::gil_scoped_release release;
        tdpbf16ps_tile(isa, pa, pb, pc);
      },
      py::arg("isa"), py::arg("a"), py::arg("b"), py::arg("c"),
      "c += a . b by one TDPBF16PS of the amx / amx_emu object (c updated in place).");
}
