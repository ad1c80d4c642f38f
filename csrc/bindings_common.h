// What the binding files share (bindings.cpp, bindings_decode.cpp): array
// views (strides, shapes, dtypes, checked data pointers), the common q / k /
// v / o binding, the dtype dispatch, and the Ctrl-C epilogue. Checks here
// are only those that keep the kernels in bounds; user-facing messages live
// in the Python layer.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attn_fast/attention.h"

namespace attn_fast {
namespace bindings {

namespace py = pybind11;

// After a kernel returned, with the GIL held again: a signal handler that
// raised during the call (the kernel stopped early, its outputs are partly
// written) turns into that exception, so nothing is returned.
inline void raise_if_interrupted() {
  if (PyErr_Occurred()) throw py::error_already_set();
}

inline Strides4 strides4(const py::array& x, const char* name) {
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

inline std::string shape_of(const py::array& x) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < x.ndim(); ++i) s += (i ? ", " : "") + std::to_string(x.shape(i));
  return s + (x.ndim() == 1 ? ",)" : ")");
}

// (broadcast views have it too, with zero strides): anything smaller would be
// read out of bounds.
inline void check_shape4(const py::array& x, const char* name, int64_t b, int64_t h, int64_t l,
                         int64_t m) {
  if (x.shape(0) != b || x.shape(1) != h || x.shape(2) != l || x.shape(3) != m)
    throw py::value_error(std::string(name) + " has shape " + shape_of(x) + ", expected (" +
                          std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(l) +
                          ", " + std::to_string(m) + ")");
}

template <typename T>
inline const T* data_of(const py::object& obj, const char* name, int64_t n) {
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

// Window sides beyond any sequence mean "unbounded" anyway; clamping keeps the
// kernels' i + off +- window arithmetic far from int64 overflow.
inline int64_t clamp_window(int64_t w) { return w > (int64_t(1) << 62) ? (int64_t(1) << 62) : w; }

// q, k, v, o of storage type T: float32 / float64 arrays as themselves, fp16
// as NumPy float16, bf16 as its uint16 bit patterns (NumPy has no bfloat16;
// the Python layer views torch.bfloat16 / ml_dtypes.bfloat16 data as uint16).
template <typename T>
inline bool has_dtype(const py::array& x) {
  return py::isinstance<py::array_t<T>>(x);
}
template <>
inline bool has_dtype<bf16_t>(const py::array& x) {
  return py::isinstance<py::array_t<uint16_t>>(x);
}
template <>
inline bool has_dtype<fp16_t>(const py::array& x) {
  return x.dtype().kind() == 'f' && x.itemsize() == 2;
}

// The storage type T of q (float32, float64, float16, or bfloat16 as uint16
// bits) as f(Type<T>{}): one place that maps a NumPy dtype to a kernel type,
// so each binding writes its parameter list once.
template <typename T>
struct Type {
  using type = T;
};
template <typename F>
auto by_dtype(const py::array& q, F&& f) {
  if (py::isinstance<py::array_t<float>>(q)) return f(Type<float>{});
  if (py::isinstance<py::array_t<double>>(q)) return f(Type<double>{});
  if (has_dtype<fp16_t>(q)) return f(Type<fp16_t>{});
  if (has_dtype<bf16_t>(q)) return f(Type<bf16_t>{});
  throw py::type_error("q must be float32, float64, float16 or bfloat16 (as uint16 bits)");
}

// o writeable; the strides of q, k, v, o (4-D) into a.sq, a.sk, a.sv, a.so.
template <typename Args>
void bind_strides(Args& a, const py::array& q, const py::array& k, const py::array& v,
                  py::array& o) {
  if (!o.writeable()) throw py::value_error("o is read-only");
  a.sq = strides4(q, "q");
  a.sk = strides4(k, "k");
  a.sv = strides4(v, "v");
  a.so = strides4(o, "o");
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
  bind_strides(a, q, k, v, o);
  a.q = static_cast<const T*>(q.data());
  a.k = static_cast<const T*>(k.data());
  a.v = static_cast<const T*>(v.data());
  a.o = static_cast<T*>(o.mutable_data());
  // The bindings' default scale (NaN) means none was given.
  if (std::isnan(scale)) throw py::value_error("scale is required (a finite number), got nan");
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
inline T* lse_of(const py::object& lse, int64_t n, const char* expected) {
  if (lse.is_none()) return nullptr;
  auto arr = py::cast<py::array>(lse);
  if (!py::isinstance<py::array_t<T>>(arr) || !(arr.flags() & py::array::c_style) ||
      !arr.writeable() || arr.size() != n)
    throw py::value_error(std::string("lse must be a writeable C-contiguous array of ") + expected +
                          " elements");
  return static_cast<T*>(arr.mutable_data());
}

// A C-contiguous writeable (or readable) array of `dtype` with this shape, or a ValueError naming
// it.
template <typename T>
inline T* exact_array(const py::object& obj, const char* name, std::initializer_list<int64_t> shape,
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

}  // namespace bindings
}  // namespace attn_fast
