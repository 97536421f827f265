#include "common/request.h"

#include <thread>
#include <utility>

#include "common/liveness.h"
#include "common/poll.h"
#include "common/msg.h"

namespace dualpipe {

std::string describe(const TransferInfo& info) {
  Msg s;
  s << "rank " << info.self_rank << (info.direction == Direction::kSend ? " send to" : " recv from") << " rank "
    << info.peer_rank << " (tag " << info.tag << ", " << info.nbytes << " B";
  if (!info.dtype_name.empty()) s << " of " << info.dtype_name;
  if (!info.what.empty()) s << ", '" << info.what << "'";
  s << ")";
  return s.str();
}

Request::Request(TransferInfo info, void* ptr, double spin_us) : info_(std::move(info)), ptr_(ptr), spin_us_(spin_us) {}

bool Request::wait(double timeout_s) const {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  // Spin briefly: a ping-pong of small messages completes within microseconds,
  // and a condition-variable sleep/wake costs tens of them.
  const auto spin_until = start + std::chrono::duration<double, std::micro>(spin_us_);
  if (poll_ && !query()) poll_();
  for (int i = 0; !query(); ++i) {
    if ((i & 15) == 15 && poll_ && poll_()) continue;
    if ((i & 63) == 63) {
      if (clock::now() >= spin_until) break;
      std::this_thread::yield();
    }
    cpu_relax();
  }
  if (query()) return true;
  if (block_) {
    // Sleep where the progress comes from (one wake-up: the sender's), up to the timeout.
    for (;;) {
      if (query()) return true;
      double slice = 3600.0;
      if (timeout_s >= 0) {
        slice = timeout_s - std::chrono::duration<double>(clock::now() - start).count();
        if (slice <= 0) return query();
      }
      if (!block_(slice)) break;
    }
    if (query()) return true;
  }
  if (engage_) engage_();
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return query(); });
    return true;
  }
  const auto deadline = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  return cv_.wait_until(lk, deadline, [&] { return query(); });
}

std::string Request::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

std::string Request::timeout_message(double timeout_s) const {
  Msg s;
  s << describe(info_) << ": timed out after " << timeout_s << " s (" << bytes_done() << " of " << info_.nbytes
    << " B moved; ";
  const std::string dead = info_.peer_pid > 0 ? process_dead_reason(info_.peer_pid) : "";
  if (info_.peer_pid <= 0) {
    s << "the peer never attached to the ring)";
  } else if (!dead.empty()) {
    s << "peer pid " << info_.peer_pid << " " << dead << ")";
  } else {
    s << "peer pid " << info_.peer_pid << " is alive but has not "
      << (info_.direction == Direction::kSend ? "drained the ring)" : "sent a matching message)");
  }
  return s.str();
}

void Request::complete() { finish(State::kDone, ""); }

void Request::fail(const std::string& message) { finish(State::kFailed, message); }

void Request::finish(State s, const std::string& message) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (query()) return;  // first outcome wins
    error_ = message;
    state_.store(static_cast<int>(s), std::memory_order_release);
  }
  cv_.notify_all();
}

}  // namespace dualpipe
