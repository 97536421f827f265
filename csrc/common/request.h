// A posted transfer and its completion event (both engines: the shm engine
// completes it when the bytes have moved, the CUDA engine when the copies are
// enqueued on its comm stream).
//
// The poster gets a shared_ptr<Request> back at once; the channel's worker
// thread (or the poster itself, for a small transfer that fits right away)
// completes or fails it. wait() spins briefly, then sleeps on a condition
// variable; it never busy-waits for long. While it spins it calls the
// request's poll hook, if any: a receive's hook lets the waiting thread copy a
// small message that has landed itself instead of waiting for the worker to
// wake up and hand it over (one thread hand-off less on the latency path).
// A request with a block hook then sleeps through it (the shm engine: on the
// ring's futex, woken by the sender's publish, and copies the message itself),
// and one with an engage hook calls it before it sleeps on its condition
// variable: the shm engine's worker leaves small receives to their waiters and
// takes one over only then.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

namespace dualpipe {

enum class Direction : std::uint8_t { kSend = 0, kRecv = 1 };

//! What a request is, for error messages. All fields are fixed at post time.
struct TransferInfo {
  Direction direction = Direction::kSend;
  int self_rank = -1;
  int peer_rank = -1;
  int peer_pid = 0;
  std::int64_t tag = 0;
  std::uint64_t nbytes = 0;
  std::int32_t dtype = 0;
  std::string dtype_name;  //!< optional, e.g. "Float" (the CUDA engine matches on it)
  std::string what;  //!< caller's label, e.g. "3RECV_F7 tensor 0"
};

//! "rank 0 recv from rank 1 (tag 3, 4096 B, '3RECV_F7 tensor 0')"
std::string describe(const TransferInfo& info);

class Request {
 public:
  enum class State : int { kPending = 0, kDone = 1, kFailed = 2 };

  Request(TransferInfo info, void* ptr, double spin_us);

  //! Wait until the request finished (done or failed) or `timeout_s` passed.
  //! Returns false on timeout. timeout_s < 0 waits forever.
  bool wait(double timeout_s) const;
  //! True once done or failed (non-blocking).
  bool query() const { return state_.load(std::memory_order_acquire) != static_cast<int>(State::kPending); }
  State state() const { return static_cast<State>(state_.load(std::memory_order_acquire)); }
  //! The failure message (empty unless failed).
  std::string error() const;
  //! Message for a wait that timed out after `timeout_s` seconds.
  std::string timeout_message(double timeout_s) const;

  const TransferInfo& info() const { return info_; }
  void* ptr() const { return ptr_; }
  //! Bytes moved so far (progress, for diagnostics).
  std::uint64_t bytes_done() const { return bytes_done_.load(std::memory_order_relaxed); }
  void add_progress(std::uint64_t n) { bytes_done_.fetch_add(n, std::memory_order_relaxed); }

  //! Set before the request is shared: called by wait() while it spins; returns
  //! true when it made progress. It must not block.
  void set_poll(std::function<bool()> poll) { poll_ = std::move(poll); }
  //! Set before the request is shared: called by wait() when it stops spinning and
  //! is about to sleep, so that whoever polls on the waiter's behalf (the channel's
  //! worker) takes over. It must not block.
  void set_engage(std::function<void()> engage) { engage_ = std::move(engage); }
  //! Set before the request is shared: called by wait() after its spin, in a loop,
  //! to sleep until the request may have progressed (at most `slice_s` seconds),
  //! copying what it can on the way (see set_poll). Returns false when it cannot
  //! help (the caller then engages and sleeps on the condition variable).
  void set_block(std::function<bool(double)> block) { block_ = std::move(block); }

  //! Called once by whoever finishes the request.
  void complete();
  void fail(const std::string& message);

 private:
  void finish(State s, const std::string& message);

  const TransferInfo info_;
  void* const ptr_;
  const double spin_us_;
  std::function<bool()> poll_;  // fixed before the request is shared
  std::function<void()> engage_;  // fixed before the request is shared
  std::function<bool(double)> block_;  // fixed before the request is shared
  std::atomic<int> state_{static_cast<int>(State::kPending)};
  std::atomic<std::uint64_t> bytes_done_{0};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::string error_;  // guarded by mu_; written before state_ becomes kFailed
};

}  // namespace dualpipe
