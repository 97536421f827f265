// The parts of a shm channel both sides share: configuration, ring waits,
// closing. The send side is in shm_send.cpp, the receive side in shm_recv.cpp.
#include "shm_channel.h"

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "common/liveness.h"
#include "shm_channel_internal.h"

namespace dualpipe::shm {

using namespace detail;  // NOLINT: this file's own helpers

std::uint64_t pipeline_chunk_bytes(std::uint64_t nbytes, std::uint64_t slot_bytes) {
  // Aim for >= kPipelineDepth chunks so that a message of a few slots still
  // overlaps the sender's copy-in with the receiver's copy-out; chunks stay
  // page multiples (aligned copies) and no smaller than kMinChunk (per-chunk
  // handshakes cost about a microsecond).
  constexpr std::uint64_t kPipelineDepth = 8, kPage = 4096, kMinChunk = 16 * 1024;
  const std::uint64_t want = (nbytes / kPipelineDepth + kPage - 1) / kPage * kPage;
  return std::min(slot_bytes, std::max(want, kMinChunk));
}

void ChannelConfig::validate() const {
  if (num_slots < 2) throw std::invalid_argument("num_slots must be >= 2 (double buffering), got " +
                                                 std::to_string(num_slots));
  if (num_slots > (1u << 20)) throw std::invalid_argument("num_slots must be <= 2^20");
  if (slot_bytes < 64) throw std::invalid_argument("slot_bytes must be >= 64, got " + std::to_string(slot_bytes));
  if (spin_us < 0) throw std::invalid_argument("spin_us must be >= 0");
  if (!(recv_poll_ms >= 0)) throw std::invalid_argument("recv_poll_ms must be >= 0");
  if (!(liveness_interval_s > 0)) throw std::invalid_argument("liveness_interval_s must be > 0");
  if (single_copy_min_bytes < 1) throw std::invalid_argument("single_copy_min_bytes must be >= 1");
}

std::shared_ptr<ShmSegment> create_ring_segment(const ChannelConfig& cfg, int src_rank, int dst_rank) {
  cfg.validate();
  const std::size_t bytes = ring_segment_bytes(cfg.num_slots, cfg.slot_bytes);
  // Anonymous (no /dev/shm name that a process killed before its peer mapped the ring could leave behind)
  // unless DUALPIPE_KERNELS_SHM_NAMED=1 asks for names.
  const std::string label = "r" + std::to_string(src_rank) + "to" + std::to_string(dst_rank);
  auto seg = std::make_shared<ShmSegment>(anonymous_segments_enabled() ? ShmSegment::create_anonymous(label, bytes)
                                                                       : ShmSegment::create(label, bytes));
  RingView::initialise(seg->data(), seg->size(), cfg.num_slots, cfg.slot_bytes, src_rank, dst_rank);
  return seg;
}

// ---------------------------------------------------------------- Channel

Channel::Channel(Side side, std::shared_ptr<ShmSegment> segment, int self_rank, int peer_rank, ChannelConfig cfg)
    : side_(side),
      segment_(std::move(segment)),
      ring_(RingView::attach(segment_->data(), segment_->size())),
      self_rank_(self_rank),
      peer_rank_(peer_rank),
      cfg_(std::move(cfg)),
      owner_pid_(static_cast<int>(::getpid())) {
  cfg_.validate();
  RingHeader* h = ring_.header();
  h->pid[idx(side_)].store(static_cast<std::int32_t>(::getpid()), std::memory_order_release);
  h->state[idx(side_)].store(static_cast<std::uint32_t>(SideState::kAttached), std::memory_order_release);
}

int Channel::peer_pid() const { return ring_.header()->pid[idx(other(side_))].load(std::memory_order_acquire); }

bool Channel::single_copy_active() const {
  return cfg_.single_copy && ring_.header()->single_copy.load(std::memory_order_acquire) ==
                                 static_cast<std::uint32_t>(SingleCopy::kPermitted);
}

void Channel::close() {
  if (static_cast<int>(::getpid()) != owner_pid_) {
    // A forked child: the worker thread does not exist here (joining it is
    // undefined), mu_ may have been copied while a parent thread held it, and
    // the ring belongs to the parent, whose peer must not see "closed". Touch
    // nothing; leak the thread handle instead of destroying a joinable one.
    if (worker_.joinable()) new std::thread(std::move(worker_));
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  RingHeader* h = ring_.header();
  // Our worker may sleep on either word; waking all sleepers also wakes the peer's (spuriously: harmless).
  futex_wake_all(&h->head);
  futex_wake_all(&h->tail);
  if (worker_.joinable()) worker_.join();
  {
    std::lock_guard<std::mutex> lk(mu_);
    fail_pending_locked("rank " + std::to_string(self_rank_) + " closed the channel");
  }
  h->state[idx(side_)].store(static_cast<std::uint32_t>(SideState::kClosed), std::memory_order_seq_cst);
  futex_wake_all(&h->head);
  futex_wake_all(&h->tail);
}

void Channel::fail_all(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;  // close() failed everything already
    if (!failed_.load(std::memory_order_relaxed)) {
      failure_ = why;
      failed_.store(true, std::memory_order_release);
    }
    if (broken_.empty()) broken_ = why;  // every later post fails with it
    fail_pending_locked(why);
  }
  cv_.notify_all();
  // A waiter asleep on the ring (its own block hook, or our worker) wakes now and sees the failure;
  // the peer's sleepers wake too, spuriously (harmless).
  RingHeader* h = ring_.header();
  futex_wake_all(&h->head);
  futex_wake_all(&h->tail);
}

bool Channel::fail_if_unusable_locked(Request& req) const {
  if (closed_) {
    req.fail(describe(req.info()) + ": the channel is closed");
  } else if (!broken_.empty()) {
    req.fail(describe(req.info()) + ": " + broken_);
  } else {
    return false;
  }
  return true;
}

void Channel::ensure_worker() {
  if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
}

void Channel::spin_for_post(std::unique_lock<std::mutex>& lk) {
  const std::uint32_t seen = post_count_.load(std::memory_order_relaxed);
  lk.unlock();
  const auto spin_until = Clock::now() + seconds(std::min(cfg_.spin_us, kWorkerSpinUs) * 1e-6);
  for (int i = 0; post_count_.load(std::memory_order_relaxed) == seen && !stop_.load(std::memory_order_relaxed);
       ++i) {
    if ((i & 63) == 63) {
      if (Clock::now() >= spin_until) break;
      std::this_thread::yield();
    }
    cpu_relax();
  }
  lk.lock();
}

TransferInfo Channel::make_info(Direction d, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                std::string what) const {
  TransferInfo info;
  info.direction = d;
  info.self_rank = self_rank_;
  info.peer_rank = peer_rank_;
  info.peer_pid = peer_pid();
  info.tag = tag;
  info.nbytes = nbytes;
  info.dtype = dtype;
  info.what = std::move(what);
  return info;
}

std::string Channel::dtype_name(std::int32_t code) const {
  if (code >= 0 && static_cast<std::size_t>(code) < cfg_.dtype_names.size()) return cfg_.dtype_names[code];
  return "dtype code " + std::to_string(code);
}

void Channel::wake_if_waiting(std::atomic<std::uint32_t>* word, std::atomic<std::uint32_t>* waiters) {
  if (waiters->load(std::memory_order_seq_cst) != 0) futex_wake_all(word);
}

}  // namespace dualpipe::shm
