// Polling helpers shared by both engines: a pause for tight spin loops and a
// backoff for host threads that poll shared counters or device events.
#pragma once

#include <chrono>
#include <thread>

namespace dualpipe {

//! A polite pause for spin loops.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

//! Sleeps a little longer the longer a poll has waited: low latency for short
//! waits without burning a core on long ones.
inline void backoff(std::chrono::steady_clock::duration waited) {
  if (waited < std::chrono::microseconds(200)) {
    std::this_thread::yield();
  } else if (waited < std::chrono::milliseconds(10)) {
    std::this_thread::sleep_for(std::chrono::microseconds(10));
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

//! For a worker that polls shared counters on behalf of posted work (the CUDA
//! IPC engine): spins for the first 50 us, yields up to 2 ms, then sleeps 20 us
//! (100 us after 50 ms). Callers restart `waited` at every new post, so that a
//! wait that was idle does not sit in the slow regime when work arrives.
inline void poll_pause(std::chrono::steady_clock::duration waited) {
  if (waited < std::chrono::microseconds(50)) {
    for (int i = 0; i < 64; ++i) cpu_relax();
  } else if (waited < std::chrono::milliseconds(2)) {
    std::this_thread::yield();
  } else if (waited < std::chrono::milliseconds(50)) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace dualpipe
