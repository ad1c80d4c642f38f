// Cooperative cancellation of a kernel call (Ctrl-C while a long call runs).
//
// A kernel entry point creates one CancelToken on the calling thread, before
// its parallel region, and calls poll() between work items and between key
// blocks (never inside a micro-kernel). poll() is one relaxed atomic load on
// every thread; on the thread that created the token it also reads
// steady_clock at every few polls and, at most every kPollInterval (the first
// time kPollInterval after the first read, so short calls never do it), asks
// the interrupt check installed by the bindings whether the call should stop.
// The Python bindings install a check that takes the GIL and calls
// PyErr_CheckSignals(): when a signal handler raised (KeyboardInterrupt for
// SIGINT) the check returns true and leaves the Python error set; the kernel
// then returns early (its outputs partly written) and the binding, after
// reacquiring the GIL, raises that error. Without a check (the fuzzer, C++
// callers) poll() only reads the flag, which nothing sets.
//
// Everything here is baseline code (csrc/interrupt.cpp): no SIMD, no inline
// function bodies, so the per-ISA kernel objects that include this header
// never emit a copy of these functions (see seq.h on the COMDAT hazard).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

namespace attn_fast {

// Returns true when the running call should stop. Called on the thread that
// started the call, with no locks held by the kernel.
using InterruptCheck = bool (*)();

// Installs (or, with nullptr, removes) the process-wide check. The bindings
// install theirs at import.
void set_interrupt_check(InterruptCheck fn);

class CancelToken {
 public:
  CancelToken();  // on the calling thread, before any worker starts
  CancelToken(const CancelToken&) = delete;
  CancelToken& operator=(const CancelToken&) = delete;

  // true: stop now (skip the remaining work items). Safe from any thread.
  bool poll();
  // true once some poll() returned true.
  bool cancelled() const;

  // Every thread of a team calls this after its share of a worksharing loop
  // (an `omp for nowait`), before the barrier that ends it. The owner thread
  // then waits there for the others, polling every couple of milliseconds:
  // otherwise a call whose last items run on the workers (one head, say)
  // would not look for Ctrl-C while the owner sat in the barrier. Others
  // return at once. The team is the enclosing parallel region's.
  void finish_share();

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> finished_{0};
  InterruptCheck check_ = nullptr;
  std::thread::id owner_;
  int64_t next_ns_ = 0;  // steady_clock time of the next check; 0: not yet read (owner only)
  uint32_t polls_ = 0;   // the owner's polls (it reads the clock at every kClockEvery-th)
};

}  // namespace attn_fast
