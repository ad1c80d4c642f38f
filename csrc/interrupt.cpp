// Cancellation tokens for kernel calls (see attn_fast/interrupt.h); baseline.
#include "attn_fast/interrupt.h"

#include <chrono>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <thread>

namespace attn_fast {

namespace {

// 25 ms: a SIGINT stops a call within a few tens of milliseconds (plus the
// longest work item in flight), and the check (which takes the GIL) runs at
// most 40 times a second.
constexpr int64_t kPollIntervalNs = 25'000'000;
// The owner reads the clock at every 8th poll only: poll sites sit between key
// blocks and work items (microseconds or more apart), where a clock read per poll
// was 2 % of a 16-key decode step (bench/NOTES.md#decode-call-cost), while 8 polls
// delay a check by microseconds to milliseconds.
constexpr uint32_t kClockEvery = 8;

std::atomic<InterruptCheck> g_check{nullptr};

// The spin-wait hint (x86 PAUSE, baseline SSE2; ARM YIELD), as OpenMP barriers use.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void set_interrupt_check(InterruptCheck fn) { g_check.store(fn); }

CancelToken::CancelToken() : check_(g_check.load()), owner_(std::this_thread::get_id()) {}

bool CancelToken::poll() {
  if (stop_.load(std::memory_order_relaxed)) return true;
  if (check_ == nullptr || std::this_thread::get_id() != owner_) return false;
  if (++polls_ % kClockEvery != 0) return false;
  const int64_t t = now_ns();
  if (next_ns_ == 0) {  // the first read starts the interval: a short call never checks
    next_ns_ = t + kPollIntervalNs;
    return false;
  }
  if (t < next_ns_) return false;
  if (check_()) {
    stop_.store(true, std::memory_order_relaxed);
    return true;
  }
  next_ns_ = now_ns() + kPollIntervalNs;  // after the check: waiting for the GIL does not count
  return false;
}

bool CancelToken::cancelled() const { return stop_.load(std::memory_order_relaxed); }

void CancelToken::finish_share() {
#ifdef _OPENMP
  const int team_size = omp_get_num_threads();  // the team of the enclosing parallel region
#else
  const int team_size = 1;
#endif
  if (std::this_thread::get_id() != owner_) {
    finished_.fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  // The owner waits for the other team_size - 1 (nothing to poll for
  // without a check: the barrier does it). It spins for the first 2 ms, as
  // an OpenMP barrier does (a short wait costs no wake-up latency; no
  // sched_yield, which on a busy machine can hand the core away for a whole
  // time slice), then sleeps 1 ms at a time so a long tail does not burn a core.
  if (check_ == nullptr || team_size <= 1) return;
  const int64_t t0 = now_ns();
  while (finished_.load(std::memory_order_acquire) < team_size - 1) {
    if (now_ns() - t0 > 2'000'000) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      for (int i = 0; i < 32; ++i) cpu_relax();  // leave the core's pipes to a sibling that works
    }
    poll();
  }
  // Safe to reset: the others are past their increment and held by the
  // barrier that follows until the owner reaches it too.
  finished_.store(0, std::memory_order_relaxed);
}

}  // namespace attn_fast
