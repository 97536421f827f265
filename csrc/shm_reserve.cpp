// Reserved ring slots of the send side: the caller writes a message straight
// into the shared memory the receiver reads (no staging copy). See shm_channel.h.
#include <stdexcept>

#include "common/liveness.h"
#include "shm_channel.h"
#include "shm_channel_internal.h"
#include "common/msg.h"

namespace dualpipe::shm {

using namespace detail;  // NOLINT: this file's own helpers

// ---------------------------------------------------------------- SlotReservation

SlotReservation::~SlotReservation() { abort(); }

void SlotReservation::commit() {
  if (!open_) throw std::logic_error(describe(info_) + ": the reserved slot was already committed or aborted");
  open_ = false;
  if (std::string err = ch_->commit_reserved(info_); !err.empty()) {
    throw std::runtime_error(describe(info_) + ": " + err);
  }
}

void SlotReservation::abort() {
  if (!open_) return;
  open_ = false;
  ch_->release_token();  // head_ never moved: the slot's bytes are simply overwritten later
}

// ---------------------------------------------------------------- SendChannel

std::string SendChannel::take_token_until(Clock::time_point deadline, const TransferInfo& info) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (closed_) return "the channel is closed";
    if (!broken_.empty()) return broken_;
    if (queue_.empty() && !busy_) {
      busy_ = true;
      return "";
    }
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && (!queue_.empty() || busy_)) return "timeout";
  }
}

void SendChannel::release_token() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    busy_ = false;
  }
  cv_.notify_all();  // the worker (sends queued behind the reservation) and other reservers
}

std::unique_ptr<SlotReservation> SendChannel::reserve(std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                                      std::string what, double wait_s, std::string* why_not) {
  TransferInfo info = make_info(Direction::kSend, nbytes, tag, dtype, std::move(what));
  if (nbytes > ring_.slot_bytes()) {
    throw std::invalid_argument(describe(info) + ": cannot reserve " + std::to_string(nbytes) +
                                " B in one ring slot of " + std::to_string(ring_.slot_bytes()) + " B; post() it");
  }
  if (!(wait_s >= 0)) throw std::invalid_argument(describe(info) + ": wait_s must be >= 0");
  const auto start = Clock::now();
  const auto deadline = start + seconds(wait_s);
  std::string err = take_token_until(deadline, info);
  const char* waiting_for = "the sends queued ahead of it";
  if (err.empty()) {
    // We hold the token: wait for the receiver to free a slot (the ring's flow control).
    RingHeader* h = ring_.header();
    const std::uint32_t slots = ring_.num_slots();
    auto free_slot = [&] { return static_cast<std::uint32_t>(head_) - h->tail.load(std::memory_order_acquire) < slots; };
    if (std::string e = ring_.error(); !e.empty()) {
      err = "channel broken: " + e;
    } else if (!free_slot()) {
      err = wait_ring(&h->tail, &h->tail_waiters, [&] { return free_slot() || Clock::now() >= deadline; });
      if (err.empty() && !free_slot()) err = "timeout";
      waiting_for = "a free ring slot (the receiver has not drained the ring)";
    }
    if (err.empty()) {
      auto r = std::unique_ptr<SlotReservation>(new SlotReservation(this, ring_.slot_data(head_), std::move(info)));
      return r;
    }
    release_token();
  }
  if (err != "timeout") throw std::runtime_error(describe(info) + ": " + err);
  if (why_not != nullptr) {
    Msg s;
    s << describe(info) << ": no ring slot reserved within " << wait_s << " s, waiting for " << waiting_for;
    const int pid = peer_pid();
    if (pid > 0) {
      const std::string dead = process_dead_reason(pid);
      s << " (peer pid " << pid << (dead.empty() ? " is alive)" : " " + dead + ")");
    } else {
      s << " (the peer never attached to the ring)";
    }
    *why_not = s.str();
  }
  return nullptr;
}

std::string SendChannel::commit_reserved(const TransferInfo& info) {
  std::string err;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) err = "the channel was closed before the reserved slot was committed";
    else if (!broken_.empty()) err = broken_;
  }
  if (err.empty()) {
    if (std::string e = ring_.error(); !e.empty()) err = "channel broken: " + e;
  }
  if (err.empty()) {
    fill_header(info, 0, info.nbytes, ChunkKind::kPayload);
    publish();
    ++next_seq_;
    reserved_bytes_.fetch_add(info.nbytes, std::memory_order_relaxed);
    reserved_messages_.fetch_add(1, std::memory_order_relaxed);
  }
  release_token();
  return err;
}

SendStats SendChannel::stats() const {
  SendStats s;
  s.copied_bytes = copied_bytes_.load(std::memory_order_relaxed);
  s.copied_messages = copied_messages_.load(std::memory_order_relaxed);
  s.reserved_bytes = reserved_bytes_.load(std::memory_order_relaxed);
  s.reserved_messages = reserved_messages_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace dualpipe::shm
