// The send side of a shm channel: posting, the worker that fills the ring,
// single-copy descriptors. See shm_channel.h.
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

// ---------------------------------------------------------------- SendChannel

SendChannel::SendChannel(std::shared_ptr<ShmSegment> segment, int self_rank, int peer_rank, ChannelConfig cfg)
    : Channel(Side::kSender, std::move(segment), self_rank, peer_rank, std::move(cfg)) {
  head_ = ring_.header()->head.load(std::memory_order_acquire);
  // The word the receiver reads back to test whether it may read our memory.
  ring_.header()->sender_probe_addr.store(reinterpret_cast<std::uintptr_t>(&ring_.header()->magic),
                                          std::memory_order_release);
}

SendChannel::~SendChannel() { close(); }

std::shared_ptr<Request> SendChannel::post(const void* src, std::uint64_t nbytes, std::int64_t tag,
                                           std::int32_t dtype, std::string what) {
  if (src == nullptr && nbytes != 0) throw std::invalid_argument("send of " + std::to_string(nbytes) +
                                                                 " bytes from a null pointer");
  auto req = std::make_shared<Request>(make_info(Direction::kSend, nbytes, tag, dtype, std::move(what)),
                                       const_cast<void*>(src), cfg_.spin_us);
  std::unique_lock<std::mutex> lk(mu_);
  if (fail_if_unusable_locked(*req)) return req;
  copied_messages_.fetch_add(1, std::memory_order_relaxed);
  // Fast path: nothing ahead of us and the whole message fits in a free slot.
  if (inline_slot_free_locked(nbytes)) {
    write_chunk(*req, 0, nbytes);
    ++next_seq_;
    req->complete();
    return req;
  }
  queue_.push_back(req);
  post_count_.fetch_add(1, std::memory_order_relaxed);
  ensure_worker();
  lk.unlock();
  cv_.notify_all();  // (a reserver may sleep on cv_ too)
  return req;
}

bool SendChannel::try_post_gather(const std::vector<Piece>& pieces, std::uint64_t nbytes, std::int64_t tag,
                                  std::int32_t dtype) {
  std::uint64_t end = 0;
  for (const Piece& p : pieces) {
    if (p.offset < end || p.offset > nbytes || p.nbytes > nbytes - p.offset || (p.src == nullptr && p.nbytes != 0)) {
      throw std::invalid_argument("gather piece of " + std::to_string(p.nbytes) + " B at offset " +
                                  std::to_string(p.offset) + " lies outside a " + std::to_string(nbytes) +
                                  " B message or overlaps the piece before it");
    }
    end = p.offset + p.nbytes;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_ || !broken_.empty() || !inline_slot_free_locked(nbytes)) return false;
  TransferInfo info;
  info.nbytes = nbytes;
  info.tag = tag;
  info.dtype = dtype;
  fill_header(info, 0, nbytes, ChunkKind::kPayload);
  unsigned char* dst = ring_.slot_data(head_);
  std::uint64_t pos = 0;
  for (const Piece& p : pieces) {
    if (p.offset > pos) std::memset(dst + pos, 0, p.offset - pos);
    if (p.nbytes != 0) std::memcpy(dst + p.offset, p.src, p.nbytes);
    pos = p.offset + p.nbytes;
  }
  if (pos < nbytes) std::memset(dst + pos, 0, nbytes - pos);
  copied_messages_.fetch_add(1, std::memory_order_relaxed);
  copied_bytes_.fetch_add(nbytes, std::memory_order_relaxed);
  publish();
  ++next_seq_;
  return true;
}

bool SendChannel::inline_slot_free_locked(std::uint64_t nbytes) const {
  return queue_.empty() && !busy_ && nbytes <= cfg_.inline_max_bytes && nbytes <= ring_.slot_bytes() &&
         static_cast<std::uint32_t>(head_) - ring_.header()->tail.load(std::memory_order_acquire) < ring_.num_slots() &&
         ring_.error().empty();
}

void SendChannel::fill_header(const TransferInfo& info, std::uint64_t offset, std::uint64_t n, ChunkKind kind) {
  SlotHeader* sh = ring_.slot_header(head_);
  sh->msg_seq = next_seq_;
  sh->nbytes = info.nbytes;
  sh->offset = offset;
  sh->tag = info.tag;
  sh->chunk_bytes = n;
  sh->dtype = info.dtype;
  sh->kind = static_cast<std::uint32_t>(kind);
}

void SendChannel::publish() {
  RingHeader* h = ring_.header();
  ++head_;
  // seq_cst (not just release): orders the store before our read of head_waiters (see shm_ring.h).
  h->head.store(static_cast<std::uint32_t>(head_), std::memory_order_seq_cst);
  wake_if_waiting(&h->head, &h->head_waiters);
}

void SendChannel::write_chunk(const Request& req, std::uint64_t offset, std::uint64_t n) {
  fill_header(req.info(), offset, n, ChunkKind::kPayload);
  if (n != 0) std::memcpy(ring_.slot_data(head_), static_cast<const unsigned char*>(req.ptr()) + offset, n);
  copied_bytes_.fetch_add(n, std::memory_order_relaxed);
  publish();
}

std::string SendChannel::run_single_copy(Request& req) {
  RingHeader* h = ring_.header();
  const std::uint32_t slots = ring_.num_slots();
  std::string err = wait_ring(&h->tail, &h->tail_waiters, [&] {
    return static_cast<std::uint32_t>(head_) - h->tail.load(std::memory_order_acquire) < slots;
  });
  if (!err.empty()) return err;
  fill_header(req.info(), 0, 0, ChunkKind::kDescriptor);
  RemoteDescriptor d{};
  d.address = reinterpret_cast<std::uintptr_t>(req.ptr());
  d.pid = static_cast<std::int32_t>(::getpid());
  std::memcpy(ring_.slot_data(head_), &d, sizeof d);
  publish();
  // The receiver releases the descriptor's slot only after its last read of our
  // buffer; it is the newest chunk, so tail == head means "read and done".
  err = wait_ring(&h->tail, &h->tail_waiters,
                  [&] { return h->tail.load(std::memory_order_acquire) == static_cast<std::uint32_t>(head_); });
  if (!err.empty()) return err;
  req.add_progress(req.info().nbytes);
  ++next_seq_;
  return "";
}

std::string SendChannel::run(Request& req) {
  RingHeader* h = ring_.header();
  if (std::string e = ring_.error(); !e.empty()) return "channel broken: " + e;
  const std::uint64_t nbytes = req.info().nbytes;
  if (nbytes >= cfg_.single_copy_min_bytes && single_copy_active()) return run_single_copy(req);
  const std::uint64_t slot = pipeline_chunk_bytes(nbytes, ring_.slot_bytes());
  const std::uint32_t slots = ring_.num_slots();
  std::uint64_t offset = 0;
  do {  // at least one chunk: a 0-byte message still carries its header
    const std::uint64_t n = std::min(slot, nbytes - offset);
    std::string err =
        wait_ring(&h->tail, &h->tail_waiters, [&] { return static_cast<std::uint32_t>(head_) - h->tail.load(std::memory_order_acquire) < slots; });
    if (!err.empty()) return err;
    write_chunk(req, offset, n);
    offset += n;
    req.add_progress(n);
  } while (offset < nbytes);
  ++next_seq_;
  return "";
}

void SendChannel::worker_loop() {
  for (;;) {
    std::shared_ptr<Request> req;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // !busy_: a slot reservation holds the token (see reserve()).
      auto ready = [&] { return stop_.load(std::memory_order_relaxed) || (!queue_.empty() && !busy_); };
      if (!ready()) spin_for_post(lk);
      cv_.wait(lk, ready);
      if (stop_.load(std::memory_order_relaxed)) return;  // close() fails what is left
      req = queue_.front();
      queue_.pop_front();
      busy_ = true;
    }
    std::string err = run(*req);
    std::unique_lock<std::mutex> lk(mu_);
    busy_ = false;
    cv_.notify_all();  // a reserver may wait for the token
    if (err.empty()) {
      req->complete();
    } else {
      // A half-written message cannot be resumed: the channel stays broken.
      broken_ = err;
      req->fail(describe(req->info()) + ": " + err);
      fail_pending_locked(err);
    }
  }
}

void SendChannel::fail_pending_locked(const std::string& why) {
  for (auto& r : queue_) r->fail(describe(r->info()) + ": " + why);
  queue_.clear();
}

}  // namespace dualpipe::shm
