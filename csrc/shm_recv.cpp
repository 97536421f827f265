// The receive side of a shm channel: matching, draining the ring, reading a
// single-copy sender's memory. See shm_channel.h.
#include "shm_channel.h"

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "common/liveness.h"
#include "shm_channel_internal.h"
#include "common/msg.h"

namespace dualpipe::shm {

using namespace detail;  // NOLINT: this file's own helpers

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
  Msg s;
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
      if (r->info().nbytes > cfg_.inline_max_bytes) --large_posted_;
      engaged_.erase(std::remove(engaged_.begin(), engaged_.end(), r.get()), engaged_.end());
      return r;
    }
  }
  return nullptr;
}

bool RecvChannel::eager_locked() const { return cfg_.recv_poll_ms <= 0 || large_posted_ != 0 || !engaged_.empty(); }

bool RecvChannel::block_for_message(double slice_s) {
  RingHeader* h = ring_.header();
  const std::uint32_t seen = h->head.load(std::memory_order_acquire);
  if (poll_ready()) return true;  // a message was there: ours, or one out of our way
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (closed_ || !broken_.empty()) return false;  // the condition-variable wait reports it
    // Another thread is copying (maybe our message, maybe a large one for a while): it completes
    // requests without a publish, so the waiter sleeps on its request instead (engaging the worker).
    if (busy_) return false;
    // A chunk we cannot copy ourselves (a multi-chunk or large message): the worker's.
    if (static_cast<std::uint32_t>(tail_) != seen) return false;
  }
  // One sleep of at most a liveness interval: a longer wait goes to the worker,
  // which watches the peer process while it waits.
  const double cap = std::min(slice_s, cfg_.liveness_interval_s);
  h->head_waiters.fetch_add(1, std::memory_order_seq_cst);
  bool slept_through = false;
  if (h->head.load(std::memory_order_seq_cst) == seen) {
    const auto t0 = detail::Clock::now();
    futex_wait(&h->head, seen, static_cast<long>(cap * 1e9));
    slept_through = h->head.load(std::memory_order_acquire) == seen && detail::Clock::now() - t0 >= detail::seconds(cap);
  }
  h->head_waiters.fetch_sub(1, std::memory_order_seq_cst);
  return !slept_through;
}

void RecvChannel::engage(const Request* req) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    const bool pending = std::any_of(posted_.begin(), posted_.end(), [&](const auto& r) { return r.get() == req; });
    if (!pending || std::find(engaged_.begin(), engaged_.end(), req) != engaged_.end()) return;
    engaged_.push_back(req);
  }
  cv_.notify_one();
}

std::shared_ptr<Request> RecvChannel::post(void* dst, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                           std::string what) {
  if (dst == nullptr && nbytes != 0) throw std::invalid_argument("recv of " + std::to_string(nbytes) +
                                                                 " bytes into a null pointer");
  auto req = std::make_shared<Request>(make_info(Direction::kRecv, nbytes, tag, dtype, std::move(what)), dst,
                                       cfg_.spin_us);
  const bool small = nbytes <= cfg_.inline_max_bytes;
  if (small) {
    // Weak: a request may outlive its channel (the Python side holds it after close()).
    req->set_poll([self = weak_from_this()] {
      auto ch = self.lock();
      return ch && ch->poll_ready();
    });
    if (cfg_.recv_poll_ms > 0) {  // the waiter's to copy; otherwise the worker watches every receive
      req->set_block([self = weak_from_this()](double slice_s) {
        auto ch = self.lock();
        return ch && ch->block_for_message(slice_s);
      });
      // The raw pointer: the hook belongs to the request, so the request outlives it.
      req->set_engage([self = weak_from_this(), r = req.get()] {
        if (auto ch = self.lock()) ch->engage(r);
      });
    }
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
  if (!small) ++large_posted_;
  if (posted_.size() == 1 && !busy_ && small && whole_message_ready_locked(tag, nbytes)) {
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
  // A small receive is its waiter's to copy: the worker, polling lazily, is woken
  // only from an untimed sleep (nothing was posted) or to watch for a large one.
  const bool wake = worker_idle_ || eager_locked();
  lk.unlock();
  if (wake) cv_.notify_one();
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
  const bool wake = eager_locked();  // a lazy worker does not wait for !busy_
  lk.unlock();
  if (wake) cv_.notify_one();  // the worker may be waiting for !busy_
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
      Msg s;
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
      Msg s;
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
    Msg s;
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
    Msg s;
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
  const bool lazy = cfg_.recv_poll_ms > 0;
  const auto poll_period = std::chrono::duration_cast<detail::Clock::duration>(
      std::chrono::duration<double, std::milli>(lazy ? cfg_.recv_poll_ms : 0.0));
  int idle_polls = 0;  // lazy looks in a row that found nothing posted
  for (;;) {
    std::uint32_t seen = 0;
    bool have = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      const auto stopped = [&] { return stop_.load(std::memory_order_relaxed); };
      // !busy_: a posting or waiting thread may be receiving inline (see post(), poll_ready()).
      auto ready = [&] { return stopped() || (!posted_.empty() && broken_.empty() && !busy_); };
      if (!ready()) {
        if (eager_locked()) spin_for_post(lk);
        if (lazy && idle_polls < kLazyIdlePolls) {
          // Recently busy with small receives: look again after poll_period, without being woken.
          if (!cv_.wait_for(lk, poll_period, ready)) {
            if (posted_.empty()) ++idle_polls;
            continue;
          }
        } else {
          worker_idle_ = true;  // every post wakes us now
          cv_.wait(lk, ready);
          worker_idle_ = false;
        }
      }
      if (stopped()) return;
      idle_polls = 0;
      seen = static_cast<std::uint32_t>(tail_);  // stable while !busy_
      have = h->head.load(std::memory_order_acquire) != seen;
      if (have) {
        busy_ = true;
      } else if (!eager_locked()) {
        // Only small receives, whose waiters copy them: look again after poll_period
        // (or when a large receive is posted or a waiter engages us), not at each publish.
        cv_.wait_for(lk, poll_period, [&] { return stopped() || eager_locked(); });
        continue;
      }
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
  large_posted_ = 0;
  engaged_.clear();
}

}  // namespace dualpipe::shm
