#include "shm_channel.h"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "process_liveness.h"

namespace dualpipe::shm {
namespace {

using Clock = std::chrono::steady_clock;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

const char* side_name(Side s) { return s == Side::kSender ? "sender" : "receiver"; }

std::size_t idx(Side s) { return static_cast<std::size_t>(s); }

Side other(Side s) { return s == Side::kSender ? Side::kReceiver : Side::kSender; }

//! One process_vm_readv call of up to n bytes; returns bytes read or -1 (errno set).
ssize_t read_peer(int pid, std::uint64_t remote, void* local, std::uint64_t n) {
  iovec l{local, static_cast<std::size_t>(n)};
  iovec r{reinterpret_cast<void*>(static_cast<std::uintptr_t>(remote)), static_cast<std::size_t>(n)};
  return ::process_vm_readv(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
}

}  // namespace

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
  if (!(liveness_interval_s > 0)) throw std::invalid_argument("liveness_interval_s must be > 0");
  if (single_copy_min_bytes < 1) throw std::invalid_argument("single_copy_min_bytes must be >= 1");
}

std::shared_ptr<ShmSegment> create_ring_segment(const ChannelConfig& cfg, int src_rank, int dst_rank) {
  cfg.validate();
  const std::size_t bytes = ring_segment_bytes(cfg.num_slots, cfg.slot_bytes);
  auto seg = std::make_shared<ShmSegment>(
      ShmSegment::create("r" + std::to_string(src_rank) + "to" + std::to_string(dst_rank), bytes));
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
  const auto spin_until = Clock::now() + seconds(cfg_.spin_us * 1e-6);
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

template <class Ready>
std::string Channel::wait_ring(std::atomic<std::uint32_t>* word, std::atomic<std::uint32_t>* waiters, Ready ready,
                               bool spin) {
  if (ready()) return "";
  const auto spin_until = Clock::now() + seconds(cfg_.spin_us * 1e-6);
  for (int i = 0; spin; ++i) {
    if (ready()) return "";
    if ((i & 63) == 63) {
      if (Clock::now() >= spin_until || stop_.load(std::memory_order_relaxed)) break;
      std::this_thread::yield();  // let the peer run if it shares our core
    }
    cpu_relax();
  }
  RingHeader* h = ring_.header();
  const Side peer = other(side_);
  const long sleep_ns = static_cast<long>(std::min(cfg_.liveness_interval_s, 0.005) * 1e9);
  auto next_liveness = Clock::now();
  for (;;) {
    if (ready()) return "";
    if (stop_.load(std::memory_order_acquire)) return "rank " + std::to_string(self_rank_) + " closed the channel";
    if (std::string e = ring_.error(); !e.empty()) return "channel broken: " + e;
    if (h->state[idx(peer)].load(std::memory_order_acquire) == static_cast<std::uint32_t>(SideState::kClosed)) {
      if (ready()) return "";  // the peer published before it closed
      return "peer rank " + std::to_string(peer_rank_) + " (" + side_name(peer) + ") closed its end of the channel";
    }
    const auto now = Clock::now();
    if (now >= next_liveness) {
      const int pid = h->pid[idx(peer)].load(std::memory_order_acquire);
      if (pid != 0) {
        if (std::string why = process_dead_reason(pid); !why.empty()) {
          return "peer rank " + std::to_string(peer_rank_) + " (pid " + std::to_string(pid) + ") " + why;
        }
      }
      next_liveness = now + seconds(cfg_.liveness_interval_s);
    }
    const std::uint32_t seen = word->load(std::memory_order_seq_cst);
    waiters->fetch_add(1, std::memory_order_seq_cst);
    if (!ready()) futex_wait(word, seen, sleep_ns);
    waiters->fetch_sub(1, std::memory_order_seq_cst);
  }
}

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
  RingHeader* h = ring_.header();
  // Fast path: nothing ahead of us and the whole message fits in a free slot.
  if (queue_.empty() && !busy_ && nbytes <= cfg_.inline_max_bytes && nbytes <= ring_.slot_bytes() &&
      static_cast<std::uint32_t>(head_) - h->tail.load(std::memory_order_acquire) < ring_.num_slots() && ring_.error().empty()) {
    write_chunk(*req, 0, nbytes);
    ++next_seq_;
    req->complete();
    return req;
  }
  queue_.push_back(req);
  post_count_.fetch_add(1, std::memory_order_relaxed);
  ensure_worker();
  lk.unlock();
  cv_.notify_one();
  return req;
}

void SendChannel::write_chunk(const Request& req, std::uint64_t offset, std::uint64_t n) {
  RingHeader* h = ring_.header();
  SlotHeader* sh = ring_.slot_header(head_);
  sh->msg_seq = next_seq_;
  sh->nbytes = req.info().nbytes;
  sh->offset = offset;
  sh->tag = req.info().tag;
  sh->chunk_bytes = n;
  sh->dtype = req.info().dtype;
  sh->kind = static_cast<std::uint32_t>(ChunkKind::kPayload);
  if (n != 0) std::memcpy(ring_.slot_data(head_), static_cast<const unsigned char*>(req.ptr()) + offset, n);
  ++head_;
  // seq_cst (not just release): orders the store before our read of head_waiters (see shm_ring.h).
  h->head.store(static_cast<std::uint32_t>(head_), std::memory_order_seq_cst);
  wake_if_waiting(&h->head, &h->head_waiters);
}

std::string SendChannel::run_single_copy(Request& req) {
  RingHeader* h = ring_.header();
  const std::uint32_t slots = ring_.num_slots();
  std::string err = wait_ring(&h->tail, &h->tail_waiters, [&] {
    return static_cast<std::uint32_t>(head_) - h->tail.load(std::memory_order_acquire) < slots;
  });
  if (!err.empty()) return err;
  SlotHeader* sh = ring_.slot_header(head_);
  sh->msg_seq = next_seq_;
  sh->nbytes = req.info().nbytes;
  sh->offset = 0;
  sh->tag = req.info().tag;
  sh->chunk_bytes = 0;
  sh->dtype = req.info().dtype;
  sh->kind = static_cast<std::uint32_t>(ChunkKind::kDescriptor);
  RemoteDescriptor d{};
  d.address = reinterpret_cast<std::uintptr_t>(req.ptr());
  d.pid = static_cast<std::int32_t>(::getpid());
  std::memcpy(ring_.slot_data(head_), &d, sizeof d);
  ++head_;
  h->head.store(static_cast<std::uint32_t>(head_), std::memory_order_seq_cst);
  wake_if_waiting(&h->head, &h->head_waiters);
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
      auto ready = [&] { return stop_.load(std::memory_order_relaxed) || !queue_.empty(); };
      if (!ready()) spin_for_post(lk);
      cv_.wait(lk, ready);
      if (stop_.load(std::memory_order_relaxed)) return;  // close() fails what is left
      req = queue_.front();
      queue_.pop_front();
      busy_ = true;
    }
    std::string err = run(*req);
    std::lock_guard<std::mutex> lk(mu_);
    busy_ = false;
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

// ---------------------------------------------------------------- RecvChannel

RecvChannel::RecvChannel(std::shared_ptr<ShmSegment> segment, int self_rank, int peer_rank, ChannelConfig cfg)
    : Channel(Side::kReceiver, std::move(segment), self_rank, peer_rank, std::move(cfg)) {
  tail_ = ring_.header()->tail.load(std::memory_order_acquire);
  probe_single_copy();
}

void RecvChannel::probe_single_copy() {
  RingHeader* h = ring_.header();
  bool ok = false;
  const int pid = h->pid[idx(Side::kSender)].load(std::memory_order_acquire);
  const std::uint64_t addr = h->sender_probe_addr.load(std::memory_order_acquire);
  if (cfg_.single_copy && pid > 0 && addr != 0) {
    // EPERM under Yama ptrace_scope >= 1 (unless related) or a seccomp/container policy; then: the ring path.
    std::uint64_t word = 0;
    ok = read_peer(pid, addr, &word, sizeof word) == static_cast<ssize_t>(sizeof word) && word == kRingMagic;
  }
  h->single_copy.store(static_cast<std::uint32_t>(ok ? SingleCopy::kPermitted : SingleCopy::kUnavailable),
                       std::memory_order_release);
}

RecvChannel::~RecvChannel() { close(); }

std::size_t RecvChannel::stashed() const {
  std::lock_guard<std::mutex> lk(const_cast<std::mutex&>(mu_));
  return stash_.size();
}

std::string RecvChannel::check_match(const Request& req, std::uint64_t nbytes, std::int32_t dtype) const {
  std::ostringstream s;
  if (nbytes != req.info().nbytes) {
    s << "size mismatch: the sender's message (tag " << req.info().tag << ") has " << nbytes
      << " B but the receive expects " << req.info().nbytes << " B";
  } else if (dtype != req.info().dtype) {
    s << "dtype mismatch: the sender's message (tag " << req.info().tag << ") is " << dtype_name(dtype)
      << " but the receive expects " << dtype_name(req.info().dtype);
  }
  return s.str();
}

std::shared_ptr<Request> RecvChannel::take_posted_locked(std::int64_t tag) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if ((*it)->info().tag == tag) {
      auto r = *it;
      posted_.erase(it);
      return r;
    }
  }
  return nullptr;
}

std::shared_ptr<Request> RecvChannel::post(void* dst, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                           std::string what) {
  if (dst == nullptr && nbytes != 0) throw std::invalid_argument("recv of " + std::to_string(nbytes) +
                                                                 " bytes into a null pointer");
  auto req = std::make_shared<Request>(make_info(Direction::kRecv, nbytes, tag, dtype, std::move(what)), dst,
                                       cfg_.spin_us);
  if (nbytes <= cfg_.inline_max_bytes) {
    // Weak: a request may outlive its channel (the Python side holds it after close()).
    req->set_poll([self = weak_from_this()] {
      auto ch = self.lock();
      return ch && ch->poll_ready();
    });
  }
  std::unique_lock<std::mutex> lk(mu_);
  if (fail_if_unusable_locked(*req)) return req;
  // A message that arrived before this receive was posted (per-tag FIFO).
  for (auto it = stash_.begin(); it != stash_.end(); ++it) {
    if (it->tag != tag) continue;
    if (std::string bad = check_match(*req, it->nbytes, it->dtype); !bad.empty()) {
      stash_.erase(it);
      lk.unlock();
      break_channel(req, bad);
      return req;
    }
    if (nbytes != 0) std::memcpy(dst, it->data.data(), nbytes);
    req->add_progress(nbytes);
    stash_.erase(it);
    req->complete();
    return req;
  }
  posted_.push_back(req);
  if (posted_.size() == 1 && !busy_ && nbytes <= cfg_.inline_max_bytes && whole_message_ready_locked(tag, nbytes)) {
    // Fast path: the message is already in the ring, whole, and nobody else is
    // receiving: copy it on this thread (no hand-off to the worker, no wake-up).
    busy_ = true;  // the busy token: tail_ / next_seq_ are ours until we clear it
    lk.unlock();
    std::string err = receive_one();
    lk.lock();
    busy_ = false;
    if (!err.empty() && broken_.empty()) {
      broken_ = err;
      fail_pending_locked(err);
    }
    if (posted_.empty()) return req;  // (receives posted meanwhile are handed to the worker below)
  }
  post_count_.fetch_add(1, std::memory_order_relaxed);
  ensure_worker();
  lk.unlock();
  cv_.notify_one();
  return req;
}

bool RecvChannel::whole_message_ready_locked(std::int64_t tag, std::uint64_t nbytes) const {
  // !busy_ under mu_: the worker is not inside receive_one, so tail_ and next_seq_ are stable.
  if (ring_.header()->head.load(std::memory_order_acquire) == static_cast<std::uint32_t>(tail_)) return false;
  const SlotHeader* sh = ring_.slot_header(tail_);
  return sh->msg_seq == next_seq_ && sh->offset == 0 && sh->tag == tag && sh->nbytes == nbytes &&
         sh->chunk_bytes == nbytes && sh->kind == static_cast<std::uint32_t>(ChunkKind::kPayload);
}

bool RecvChannel::small_message_ready_locked() const {
  if (ring_.header()->head.load(std::memory_order_acquire) == static_cast<std::uint32_t>(tail_)) return false;
  const SlotHeader* sh = ring_.slot_header(tail_);
  return sh->msg_seq == next_seq_ && sh->offset == 0 && sh->chunk_bytes == sh->nbytes &&
         sh->nbytes <= cfg_.inline_max_bytes && sh->kind == static_cast<std::uint32_t>(ChunkKind::kPayload);
}

bool RecvChannel::poll_ready() {
  const RingHeader* h = ring_.header();
  // Lock-free first look (the header's tail mirrors tail_ after every drained chunk).
  if (h->head.load(std::memory_order_acquire) == h->tail.load(std::memory_order_acquire)) return false;
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_ || busy_ || !broken_.empty() || posted_.empty() || !small_message_ready_locked()) return false;
  busy_ = true;
  lk.unlock();
  std::string err = receive_one();  // the message is whole: no wait inside
  lk.lock();
  busy_ = false;
  if (!err.empty() && broken_.empty()) {
    broken_ = err;
    fail_pending_locked(err);
  }
  lk.unlock();
  cv_.notify_one();  // the worker may be waiting for !busy_
  return true;
}

void RecvChannel::break_channel(const std::shared_ptr<Request>& req, const std::string& why) {
  const std::string text = describe(req->info()) + ": " + why;
  ring_.set_error("receiver reported: " + text);
  std::lock_guard<std::mutex> lk(mu_);
  broken_ = "channel broken: " + text;
  req->fail(text);
  fail_pending_locked(broken_);
}

std::string RecvChannel::drain(const SlotHeader& first, unsigned char* dst, Request* progress) {
  if (first.kind == static_cast<std::uint32_t>(ChunkKind::kDescriptor)) return read_remote(first, dst, progress);
  RingHeader* h = ring_.header();
  const std::uint64_t nbytes = first.nbytes;
  std::uint64_t offset = 0;
  for (;;) {
    if (offset != 0) {
      std::string err =
          wait_ring(&h->head, &h->head_waiters, [&] { return h->head.load(std::memory_order_acquire) != static_cast<std::uint32_t>(tail_); });
      if (!err.empty()) return err;
    }
    const SlotHeader* sh = ring_.slot_header(tail_);
    // Each chunk must continue the message being assembled; anything else is a
    // protocol violation, and we stop before touching the caller's memory.
    if (sh->msg_seq != first.msg_seq || sh->offset != offset || sh->chunk_bytes > ring_.slot_bytes() ||
        sh->chunk_bytes > nbytes - offset || (sh->chunk_bytes == 0 && nbytes != 0)) {
      std::ostringstream s;
      s << "corrupt ring: chunk seq " << sh->msg_seq << " offset " << sh->offset << " size " << sh->chunk_bytes
        << " does not continue message " << first.msg_seq << " at offset " << offset << " of " << nbytes << " B";
      ring_.set_error(s.str());
      return s.str();
    }
    if (sh->chunk_bytes != 0) std::memcpy(dst + offset, ring_.slot_data(tail_), sh->chunk_bytes);
    offset += sh->chunk_bytes;
    if (progress != nullptr) progress->add_progress(sh->chunk_bytes);
    ++tail_;
    h->tail.store(static_cast<std::uint32_t>(tail_), std::memory_order_seq_cst);
    wake_if_waiting(&h->tail, &h->tail_waiters);
    if (offset == nbytes) return "";
  }
}

std::string RecvChannel::read_range(const RemoteDescriptor& d, std::uint64_t begin, std::uint64_t end,
                                    unsigned char* dst, Request* progress, std::uint64_t nbytes) {
  // Pieces: a close() is noticed between them, and progress moves.
  constexpr std::uint64_t kPiece = 4u << 20;
  std::uint64_t offset = begin;
  while (offset < end) {
    if (stop_.load(std::memory_order_acquire)) return "rank " + std::to_string(self_rank_) + " closed the channel";
    const std::uint64_t n = std::min(kPiece, end - offset);
    const ssize_t got = read_peer(d.pid, d.address + offset, dst + offset, n);
    if (got <= 0) {
      const int e = got < 0 ? errno : EFAULT;
      std::ostringstream s;
      s << "peer rank " << peer_rank_ << " (pid " << d.pid << ") ";
      if (e == ESRCH || !process_dead_reason(d.pid).empty()) {
        s << "exited during a single-copy read at byte " << offset << " of " << nbytes;
      } else {
        s << "could not be read with process_vm_readv at byte " << offset << " of " << nbytes << ": "
          << std::strerror(e);
      }
      return s.str();
    }
    offset += static_cast<std::uint64_t>(got);
    if (progress != nullptr) progress->add_progress(static_cast<std::uint64_t>(got));
  }
  return "";
}

std::string RecvChannel::read_remote(const SlotHeader& first, unsigned char* dst, Request* progress) {
  RingHeader* h = ring_.header();
  RemoteDescriptor d{};
  std::memcpy(&d, ring_.slot_data(tail_), sizeof d);
  const int sender_pid = h->pid[idx(Side::kSender)].load(std::memory_order_acquire);
  if (first.chunk_bytes != 0 || d.pid <= 0 || d.pid != sender_pid) {
    std::ostringstream s;
    s << "corrupt ring: descriptor of message " << first.msg_seq << " names pid " << d.pid << " (sender pid "
      << sender_pid << ") and carries " << first.chunk_bytes << " payload bytes";
    ring_.set_error(s.str());
    return s.str();
  }
  // Large messages are read by two threads at once (this worker and a helper, each
  // on one half): the kernel's per-page pinning and copying then runs on two cores.
  std::string err;
  if (first.nbytes >= kParallelReadMinBytes) {
    const std::uint64_t half = first.nbytes / 2 / 4096 * 4096;
    std::string helper_err;
    std::thread helper([&] { helper_err = read_range(d, half, first.nbytes, dst, progress, first.nbytes); });
    err = read_range(d, 0, half, dst, progress, first.nbytes);
    helper.join();
    if (err.empty()) err = helper_err;
  } else {
    err = read_range(d, 0, first.nbytes, dst, progress, first.nbytes);
  }
  if (!err.empty()) {
    if (!stop_.load(std::memory_order_acquire)) ring_.set_error(err);
    return err;
  }
  // A sender that closed its end gave up on this message and may have freed the
  // buffer while we read it (it frees only after publishing kClosed), so the
  // bytes are trusted only if it is still open now, after the last read.
  if (h->state[idx(Side::kSender)].load(std::memory_order_seq_cst) == static_cast<std::uint32_t>(SideState::kClosed)) {
    return "peer rank " + std::to_string(peer_rank_) + " (pid " + std::to_string(d.pid) +
           ") closed its end of the channel during a single-copy read";
  }
  // Done with the sender's buffer: releasing the slot is the acknowledgement.
  ++tail_;
  h->tail.store(static_cast<std::uint32_t>(tail_), std::memory_order_seq_cst);
  wake_if_waiting(&h->tail, &h->tail_waiters);
  return "";
}

std::string RecvChannel::receive_one() {
  RingHeader* h = ring_.header();
  std::string err =
      wait_ring(&h->head, &h->head_waiters, [&] { return h->head.load(std::memory_order_acquire) != static_cast<std::uint32_t>(tail_); });
  if (!err.empty()) return err;
  const SlotHeader first = *ring_.slot_header(tail_);
  if (first.msg_seq != next_seq_ || first.offset != 0 || first.kind > static_cast<std::uint32_t>(ChunkKind::kDescriptor)) {
    std::ostringstream s;
    s << "corrupt ring: expected the start of message " << next_seq_ << ", found seq " << first.msg_seq
      << " offset " << first.offset << " kind " << first.kind;
    ring_.set_error(s.str());
    return s.str();
  }
  std::shared_ptr<Request> target;
  {
    std::lock_guard<std::mutex> lk(mu_);
    target = take_posted_locked(first.tag);
  }
  if (target) {
    if (std::string bad = check_match(*target, first.nbytes, first.dtype); !bad.empty()) {
      break_channel(target, bad);
      return "";  // already reported, channel broken
    }
    err = drain(first, static_cast<unsigned char*>(target->ptr()), target.get());
    if (!err.empty()) {
      target->fail(describe(target->info()) + ": " + err);
      return err;
    }
    ++next_seq_;
    target->complete();
    return "";
  }
  // No receive wants this tag yet but another receive is waiting behind it: stash it.
  Stashed st{first.tag, first.nbytes, first.dtype, std::vector<unsigned char>(first.nbytes)};
  err = drain(first, st.data.data(), nullptr);
  if (!err.empty()) return err;
  ++next_seq_;
  std::unique_lock<std::mutex> lk(mu_);
  // A matching receive may have been posted while we copied (it saw no stash yet).
  if (auto late = take_posted_locked(st.tag)) {
    if (std::string bad = check_match(*late, st.nbytes, st.dtype); !bad.empty()) {
      lk.unlock();
      break_channel(late, bad);
      return "";
    }
    if (st.nbytes != 0) std::memcpy(late->ptr(), st.data.data(), st.nbytes);
    late->add_progress(st.nbytes);
    late->complete();
    return "";
  }
  stash_.push_back(std::move(st));
  return "";
}

void RecvChannel::worker_loop() {
  RingHeader* h = ring_.header();
  for (;;) {
    std::uint32_t seen = 0;
    bool have = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // !busy_: a posting or waiting thread may be receiving inline (see post(), poll_ready()).
      auto ready = [&] {
        return stop_.load(std::memory_order_relaxed) || (!posted_.empty() && broken_.empty() && !busy_);
      };
      if (!ready()) spin_for_post(lk);
      cv_.wait(lk, ready);
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = static_cast<std::uint32_t>(tail_);  // stable while !busy_
      have = h->head.load(std::memory_order_acquire) != seen;
      if (have) busy_ = true;
    }
    if (!have) {
      // Nothing has arrived: wait for the sender without the busy token, so that
      // a thread waiting on its receive can take the message itself when it lands.
      // No spinning: a waiter of a small receive spins (and polls) itself; the receives
      // posted ahead of need, which nobody waits on yet, can afford a futex wake-up.
      std::string err = wait_ring(
          &h->head, &h->head_waiters, [&] { return h->head.load(std::memory_order_acquire) != seen; }, false);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lk(mu_);
        if (broken_.empty() && !stop_.load(std::memory_order_relaxed)) {
          broken_ = err;
          fail_pending_locked(err);
        }
      }
      continue;
    }
    std::string err = receive_one();
    std::lock_guard<std::mutex> lk(mu_);
    busy_ = false;
    if (!err.empty() && broken_.empty()) {
      broken_ = err;
      fail_pending_locked(err);
    }
  }
}

void RecvChannel::fail_pending_locked(const std::string& why) {
  for (auto& r : posted_) r->fail(describe(r->info()) + ": " + why);
  posted_.clear();
}

}  // namespace dualpipe::shm
