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
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn_fast/attention.h"
#include "attn_fast/interrupt.h"
#include "attn_fast/linear_attn.h"
#include "bindings_common.h"

namespace py = pybind11;
using namespace attn_fast;
using namespace attn_fast::bindings;

namespace attn_fast {
namespace bindings {
void def_decode(py::module_& m);  // bindings_decode.cpp
void def_plans(py::module_& m);   // bindings_plans.cpp
}  // namespace bindings
}  // namespace attn_fast

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
// varlen offsets: n + 1 entries, non-decreasing, within [0, total] (the kernel
// reads rows cu[s] .. cu[s+1] - 1 of the packed tensor).
void check_cu(const int64_t* cu, int64_t n, int64_t total, const char* name) {
  for (int64_t s = 0; s <= n; ++s)
    if (cu[s] < 0 || cu[s] > total || (s > 0 && cu[s] < cu[s - 1]))
      throw py::value_error(std::string(name) + " must be non-decreasing within [0, " +
                            std::to_string(total) + "], got " + std::to_string(cu[s]) +
                            " at index " + std::to_string(s));
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

// The mask and score arguments of one _core.forward / _core.backward call,
// in the binding's order (after the arrays and the scale): _dispatch's
// MaskArgs and ScoreArgs records with the varlen offsets and block sizes,
// passed by position from one place (_dispatch._kernel_args). The arrays
// stay alive through the caller's arguments for the call.
struct MaskCall {
  bool causal, top_left;
  int64_t window_left, window_right;
  py::object q_lens, kv_lens, cu_q, cu_k, layout;
  int64_t layout_bq, layout_bk;
  py::object mask, bias, alibi;
  double softcap;
  py::object sinks;
  int block_q, block_k;
};

// The C++ types of a binding's parameters before (Head) or after (Tail) the mask ones.
template <class... T>
struct Params {};

// Defines `name` as f(head..., scale, MaskCall, tail...) with MaskCall's fields
// spelled out as Python parameters after the scale (by position or keyword;
// scale is required: its NaN default is refused): forward's and backward's one
// list of the mask parameters, their types and defaults. head_args / tail_args
// are the py::args of the Head / Tail parameters; doc the docstring.
template <class... Head, class... Tail, class F, class... HeadArgs, class... TailArgs>
void def_mask_call(py::module_& mod, const char* name, Params<Head...>, Params<Tail...>, F f,
                   std::tuple<HeadArgs...> head_args, std::tuple<TailArgs...> tail_args,
                   const char* doc) {
  auto fn = [f](Head... head, double scale, bool causal, bool top_left, int64_t window_left,
                int64_t window_right, py::object q_lens, py::object kv_lens, py::object cu_q,
                py::object cu_k, py::object layout, int64_t layout_bq, int64_t layout_bk,
                py::object mask, py::object bias, py::object alibi, double softcap,
                py::object sinks, int block_q, int block_k, Tail... tail) {
    MaskCall m{causal, top_left, window_left, window_right, q_lens,    kv_lens,
               cu_q,   cu_k,     layout,      layout_bq,    layout_bk, mask,
               bias,   alibi,    softcap,     sinks,        block_q,   block_k};
    return f(std::move(head)..., scale, std::move(m), std::move(tail)...);
  };
  auto mask_args = std::make_tuple(
      py::arg("scale") = std::numeric_limits<double>::quiet_NaN(), py::arg("causal") = false,
      py::arg("top_left") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
      py::arg("q_lens") = py::none(), py::arg("kv_lens") = py::none(), py::arg("cu_q") = py::none(),
      py::arg("cu_k") = py::none(), py::arg("layout") = py::none(), py::arg("layout_bq") = 1,
      py::arg("layout_bk") = 1, py::arg("mask") = py::none(), py::arg("bias") = py::none(),
      py::arg("alibi") = py::none(), py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
      py::arg("block_q") = 0, py::arg("block_k") = 0);
  std::apply([&](auto&&... a) { mod.def(name, fn, a..., doc); },
             std::tuple_cat(std::move(head_args), std::move(mask_args), std::move(tail_args)));
}

// A MaskCall into AttnArgs: varlen offsets (a.B becomes the number of
// sequences), per-batch lengths, ALiBi slopes, sinks, the block-sparse
// layout, the dense boolean mask and the additive bias, each checked against
// q's shape.
template <typename T>
void bind_mask_args(AttnArgs<T>& a, const py::array& q, const py::array& k, const MaskCall& m) {
  const py::object &cu_q = m.cu_q, &cu_k = m.cu_k, &layout = m.layout, &mask = m.mask,
                   &bias = m.bias;
  const int64_t layout_bq = m.layout_bq, layout_bk = m.layout_bk;
  const bool varlen = !cu_q.is_none();
  if (!varlen && k.shape(0) != a.B) throw py::value_error("k batch differs from q batch");
  a.softcap = m.softcap;
  a.block_q = m.block_q;
  a.block_k = m.block_k;
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
  a.q_lens = data_of<int64_t>(m.q_lens, "q_lens", varlen ? -1 : a.B);
  a.kv_lens = data_of<int64_t>(m.kv_lens, "kv_lens", varlen ? -1 : a.B);
  using C = compute_t<T>;  // lse, bias, alibi, sinks: fp32 for 16-bit storage
  a.alibi = data_of<C>(m.alibi, "alibi_slopes", a.Hq);
  a.sinks = data_of<C>(m.sinks, "sinks", a.Hq);
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

// The bound arguments of one _core.forward call (kept alive by the caller).
struct ForwardCall {
  py::array q, k, v, o;
  py::object lse;
  double scale;
  MaskCall m;
  bool reference;
};

py::tuple forward(ForwardCall& c) {
  return by_dtype(c.q, [&](auto t) {
    using T = typename decltype(t)::type;
    AttnArgs<T> a;
    const MaskCall& m = c.m;
    bind_qkvo<T>(a, c.q, c.k, c.v, c.o, c.scale, m.causal, m.top_left, m.window_left,
                 m.window_right);
    bind_shapes(a, c.q, c.k, c.v, c.o);
    bind_mask_args<T>(a, c.q, c.k, m);
    using C = compute_t<T>;  // lse: fp32 for 16-bit storage
    const int64_t lse_rows = a.cu_q ? a.Lq : a.B * a.Lq;
    a.lse = lse_of<C>(c.lse, a.Hq * lse_rows, "Hq * rows");
    AttnStats st;
    {
      py::gil_scoped_release release;
      if (c.reference)
        reference_forward(a);
      else
        st = flash_forward(a);
    }
    raise_if_interrupted();
    return py::make_tuple(st.tiles_computed, st.tiles_skipped, st.block_q, st.block_k);
  });
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
  bind_strides(a, q, k, v, o);
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

// The bound arguments of one _core.backward call (kept alive by the caller).
struct BackwardCall {
  py::array dout, q, k, v, o, lse, dq, dk, dv;
  py::object dsinks;
  double scale;
  MaskCall m;
};

void backward(BackwardCall& c) {
  return by_dtype(c.q, [&](auto t) {
    using T = typename decltype(t)::type;
    BwdArgs<T> g;
    AttnArgs<T>& a = g.f;
    const MaskCall& m = c.m;
    bind_qkvo<T>(a, c.q, c.k, c.v, c.o, c.scale, m.causal, m.top_left, m.window_left,
                 m.window_right);
    bind_shapes(a, c.q, c.k, c.v, c.o);
    if (!has_dtype<T>(c.dout)) throw py::type_error("dout must have q's dtype");
    g.sdo = strides4(c.dout, "dout");
    if (c.dout.shape(0) != a.B || c.dout.shape(1) != a.Hq || c.dout.shape(2) != a.Lq ||
        c.dout.shape(3) != a.dv)
      throw py::value_error("dout has shape " + shape_of(c.dout) + ", expected the shape of o " +
                            shape_of(c.o));
    g.dout = static_cast<const T*>(c.dout.data());
    g.sdq = grad_out<T>(c.dq, c.q, "dq");
    g.sdk = grad_out<T>(c.dk, c.k, "dk");
    g.sdv = grad_out<T>(c.dv, c.v, "dv");
    g.dq = static_cast<T*>(c.dq.mutable_data());
    g.dk = static_cast<T*>(c.dk.mutable_data());
    g.dv = static_cast<T*>(c.dv.mutable_data());
    bind_mask_args<T>(a, c.q, c.k, m);
    using C = compute_t<T>;  // lse, dsinks: fp32 for 16-bit storage
    const int64_t lse_rows = a.cu_q ? a.Lq : a.B * a.Lq;
    a.lse = const_cast<C*>(data_of<C>(c.lse, "lse", a.Hq * lse_rows));  // read only
    if (!c.dsinks.is_none()) {
      auto ds = py::cast<py::array>(c.dsinks);
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
  });
}

// The module's machine functions: the ISA, threads and OpenMP, the CPU and
// bandwidth probes, the AMX status and checks.
void def_machine(py::module_& m) {
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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "attn_fast C++ core: fused flash-attention forward kernels (internal; use attn_fast)";
  set_interrupt_check(&python_signal_raised);  // Ctrl-C stops long kernel calls
  // Tile classes (attention.h TileClass), the numbering of masks.block_summary.
  m.attr("BLOCK_MASKED") = static_cast<int>(TileClass::masked);
  m.attr("BLOCK_PARTIAL") = static_cast<int>(TileClass::partial);
  m.attr("BLOCK_VISIBLE") = static_cast<int>(TileClass::visible);
  // forward and backward: the arrays, the scale, MaskCall's fields, by position from
  // _dispatch (keywords work too).
  using A = py::array;
  def_mask_call(
      m, "forward", Params<A, A, A, A, py::object>{}, Params<bool>{},
      [](A q, A k, A v, A o, py::object lse, double scale, MaskCall mc, bool reference) {
        ForwardCall c{q, k, v, o, lse, scale, std::move(mc), reference};
        return forward(c);
      },
      std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
                      py::arg("lse") = py::none()),
      std::make_tuple(py::arg("reference") = false),
      "Fused attention forward on 4-D strided arrays; returns (tiles_computed, tiles_skipped, "
      "block_q, block_k). float16 q/k/v/o are fp16; uint16 ones hold bfloat16 bits; lse, bias, "
      "alibi and sinks are float32 for both.");
  m.def("linear_attention", &linear_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("o"), py::arg("kv") = py::none(), py::arg("k_sum") = py::none(), py::kw_only(),
        py::arg("causal") = false, py::arg("eps") = 0.0,
        "Linear attention on feature-mapped 4-D strided q, k (and v) into o; "
        "kv (B,H,d,dv) / k_sum (B,H,d) float64: optional running state, updated in place. "
        "q, k, v, o float32 or float64; or float32 q, k with 16-bit v, o (float16, or "
        "bfloat16 as uint16 bits).");
  def_decode(m);  // decode, kv_quant_append
  def_mask_call(
      m, "backward", Params<A, A, A, A, A, A, A, A, A, py::object>{}, Params<>{},
      [](A dout, A q, A k, A v, A o, A lse, A dq, A dk, A dv, py::object dsinks, double scale,
         MaskCall mc) {
        BackwardCall c{dout, q, k, v, o, lse, dq, dk, dv, dsinks, scale, std::move(mc)};
        backward(c);
      },
      std::make_tuple(py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
                      py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
                      py::arg("dsinks") = py::none()),
      std::make_tuple(),
      "Fused FlashAttention-2 backward on 4-D strided arrays: writes dq, dk, dv (and dsinks). "
      "float16 arrays are fp16, uint16 ones bfloat16 bits (dq, dk, dv, dout, o of q's dtype); "
      "lse, bias, alibi, sinks and dsinks are float32 for them.");
  def_machine(m);  // ISA, threads, machine probes, AMX checks
  def_plans(m);    // plan_key, set_torch, run_tensor_plan
}
