// Small helpers the three parts of the shm channel share (shm_channel.cpp,
// shm_send.cpp, shm_recv.cpp); not part of the engine's interface.
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdint>
#include <string>

#include "common/liveness.h"

#include "shm_channel.h"

namespace dualpipe::shm::detail {

using Clock = std::chrono::steady_clock;

inline Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

inline const char* side_name(Side s) { return s == Side::kSender ? "sender" : "receiver"; }

inline std::size_t idx(Side s) { return static_cast<std::size_t>(s); }

inline Side other(Side s) { return s == Side::kSender ? Side::kReceiver : Side::kSender; }

//! One process_vm_readv call of up to n bytes; returns bytes read or -1 (errno set).
inline ssize_t read_peer(int pid, std::uint64_t remote, void* local, std::uint64_t n) {
  iovec l{local, static_cast<std::size_t>(n)};
  iovec r{reinterpret_cast<void*>(static_cast<std::uintptr_t>(remote)), static_cast<std::size_t>(n)};
  return ::process_vm_readv(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
}

}  // namespace dualpipe::shm::detail

namespace dualpipe::shm {

template <class Ready>
std::string Channel::wait_ring(std::atomic<std::uint32_t>* word, std::atomic<std::uint32_t>* waiters, Ready ready,
                               bool spin) {
  if (ready()) return "";
  const auto spin_until = detail::Clock::now() + detail::seconds(cfg_.spin_us * 1e-6);
  for (int i = 0; spin; ++i) {
    if (ready()) return "";
    if ((i & 63) == 63) {
      if (detail::Clock::now() >= spin_until || stop_.load(std::memory_order_relaxed) ||
          failed_.load(std::memory_order_relaxed)) {
        break;
      }
      std::this_thread::yield();  // let the peer run if it shares our core
    }
    cpu_relax();
  }
  RingHeader* h = ring_.header();
  const Side peer = detail::other(side_);
  const long sleep_ns = static_cast<long>(std::min(cfg_.liveness_interval_s, 0.005) * 1e9);
  auto next_liveness = detail::Clock::now();
  for (;;) {
    if (ready()) return "";
    if (stop_.load(std::memory_order_acquire)) return "rank " + std::to_string(self_rank_) + " closed the channel";
    if (failed_.load(std::memory_order_acquire)) return failure_;
    if (std::string e = ring_.error(); !e.empty()) return "channel broken: " + e;
    if (h->state[detail::idx(peer)].load(std::memory_order_acquire) == static_cast<std::uint32_t>(SideState::kClosed)) {
      if (ready()) return "";  // the peer published before it closed
      return "peer rank " + std::to_string(peer_rank_) + " (" + detail::side_name(peer) + ") closed its end of the channel";
    }
    const auto now = detail::Clock::now();
    if (now >= next_liveness) {
      const int pid = h->pid[detail::idx(peer)].load(std::memory_order_acquire);
      if (pid != 0) {
        if (std::string why = process_dead_reason(pid); !why.empty()) {
          return "peer rank " + std::to_string(peer_rank_) + " (pid " + std::to_string(pid) + ") " + why;
        }
      }
      next_liveness = now + detail::seconds(cfg_.liveness_interval_s);
    }
    const std::uint32_t seen = word->load(std::memory_order_seq_cst);
    waiters->fetch_add(1, std::memory_order_seq_cst);
    if (!ready()) futex_wait(word, seen, sleep_ns);
    waiters->fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace dualpipe::shm
