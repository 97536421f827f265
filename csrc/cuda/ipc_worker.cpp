// CUDA IPC comm engine, host logic: the worker thread that moves chunks
// through every channel. It owns every ready channel's state and makes its
// device calls without the engine lock, which it takes only to collect new
// posts and channels. Teardown is in ipc_teardown.cpp; see ipc_engine.h for
// the protocol.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/msg.h"
#include "common/poll.h"
#include "cuda/ipc_engine.h"

namespace dualpipe::cuda {

using Clock = std::chrono::steady_clock;

namespace {
//! How often a channel with outstanding work checks that its peer's process lives.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
}  // namespace

// Host staging: chunks whose local copy has finished advance the host counter
// (sender: published, the data is in the ring; receiver: taken, the ring bytes are free).
bool Engine::retire_pending(Channel& ch) {
  bool progressed = false;
  while (!ch.pending.empty()) {
    const auto [n, ev] = ch.pending.front();
    if (!finished(*api_, api_->event_query(ev), "cudaEventQuery(host staging copy)")) break;
    pool_->give(ev);
    (ch.outgoing ? ch.ctl->published : ch.ctl->taken).store(n + 1, std::memory_order_release);
    ch.pending.pop_front();
    progressed = true;
  }
  return progressed;
}

// Stream `s` waits until the peer-written `signal` reaches `value`.
void Engine::wait_peer_signal(Channel& ch, Stream s, std::uint64_t* signal, std::uint64_t value) {
  check(*api_, api_->stream_wait_value(s, signal, value), "stream_wait_value");
  if (!ch.wait_any || reached(value, ch.wait_target)) ch.wait_target = value;
  ch.wait_any = true;
  bump(&EngineStats::stream_waits);
}

// ---------------------------------------------------------------------------
// Sending
// ---------------------------------------------------------------------------

// First chunk of a send: the comm stream waits for the producer, and a large
// send from an exportable allocation goes zero-copy. Returns op.direct_.
bool Engine::start_send(Channel& ch, Op& op) {
  if (op.started_) return op.direct_;
  check(*api_, api_->stream_wait_event(send_stream_, op.ready_event_), "cudaStreamWaitEvent(ready_event)");
  op.started_ = true;
  if (ch.staging == Staging::kIpc && options_.direct_min_bytes > 0 && op.bytes() >= options_.direct_min_bytes &&
      op.alloc_base_ != nullptr) {
    op.export_slot_ = export_for_send(ch, op);  // -1: no entry, or not exportable: staged
    op.direct_ = op.export_slot_ >= 0;
  }
  op.zero_copy_.store(op.direct_, std::memory_order_release);
  bump(op.direct_ ? &EngineStats::zero_copy_sends : &EngineStats::staged_sends);
  return op.direct_;
}

// Places staged chunk n of `bytes` bytes at the next 256-byte position of the
// byte ring (wrapping to its start when it does not fit before the end). False,
// with nothing changed, while the bytes it needs still hold a chunk the
// receiver has not taken; otherwise the send stream waits (device) for the
// drain of the last chunk it overwrites.
bool Engine::place_staged(Channel& ch, std::uint64_t bytes, std::uint64_t* offset) {
  const std::uint64_t len = (bytes + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment;
  const std::uint64_t R = ch.ring_bytes;
  std::uint64_t pos = ch.next_abs;
  if (pos % R + len > R) pos += R - pos % R;
  // Earlier chunks start at increasing absolute positions; those starting
  // before pos + len - R share bytes with [pos, pos + len) modulo R.
  const std::uint64_t taken = ch.ctl->taken.load(std::memory_order_acquire);
  std::size_t overwritten = 0;
  std::uint64_t last = 0;
  for (const auto& [m, start] : ch.staged) {
    if (start + R >= pos + len) break;
    if (!reached(taken, m + 1)) return false;  // the receiver has not enqueued its drain yet
    last = m;
    ++overwritten;
  }
  ch.staged.erase(ch.staged.begin(), ch.staged.begin() + static_cast<std::ptrdiff_t>(overwritten));
  if (overwritten > 0 && ch.staging == Staging::kIpc && (!ch.freed_wait_any || !reached(ch.freed_waited, last + 1))) {
    wait_peer_signal(ch, send_stream_, ch.freed_signal(), last + 1);
    ch.freed_waited = last + 1;
    ch.freed_wait_any = true;
  }
  ch.next_abs = pos + len;
  *offset = pos % R;
  ch.staged.emplace_back(ch.next_chunk, pos);
  return true;
}

// A zero-copy send: the chunk descriptor carries the handle, not data.
void Engine::publish_direct(Channel& ch, std::uint64_t n) {
  Op& op = *ch.queue.front();
  // "the source is ready": after the send stream's wait for the producer
  check(*api_, api_->stream_write_value(send_stream_, ch.ready_signal(), n + 1), "stream_write_value(ready)");
  ChunkDesc& d = desc_of(ch, n);
  d.msg_seq = ch.next_msg_seq;
  d.tag = op.tag();
  d.total_bytes = op.bytes();
  d.offset = 0;
  d.bytes = op.bytes();
  d.ring_offset = 0;
  std::memcpy(d.dtype, op.dtype_, kDtypeNameLen);
  d.direct = 1;
  d.src_offset = static_cast<std::uint64_t>(op.ptr_ - op.alloc_base_);
  d.src_base = reinterpret_cast<std::uint64_t>(op.alloc_base_);
  ExportEntry& e = ch.exports[static_cast<std::size_t>(op.export_slot_)];
  d.export_slot = static_cast<std::uint32_t>(op.export_slot_);
  d.export_gen = e.gen;
  d.src_handle = e.handle;
  e.last_chunk = n;
  ch.ctl->published.store(n + 1, std::memory_order_release);
  ++ch.next_chunk;
  op.offset_ = op.bytes();
  op.chunks_enqueued_.fetch_add(1);
  ch.awaiting.emplace_back(n, std::move(ch.queue.front()));
  ch.queue.pop_front();
  ++ch.next_msg_seq;
}

bool Engine::progress_send(Channel& ch) {
  bool progressed = retire_pending(ch);
  if (ch.exports_retiring > 0) collect_unmapped(ch);
  const bool ipc = ch.staging == Staging::kIpc;
  const std::uint64_t taken = ch.ctl->taken.load(std::memory_order_acquire);
  // Zero-copy sends the receiver has taken (its copy out of our buffer and
  // the freed signal after it are enqueued): the done stream waits for that
  // signal, then the op's done event. Never on the send stream, so later
  // sends do not queue behind the receiver's copy.
  while (!ch.awaiting.empty() && reached(taken, ch.awaiting.front().first + 1)) {
    const std::uint64_t n = ch.awaiting.front().first;
    std::shared_ptr<Op> op = std::move(ch.awaiting.front().second);
    ch.awaiting.pop_front();
    wait_peer_signal(ch, done_stream_, ch.freed_signal(), n + 1);
    check(*api_, api_->event_record(op->done_event_, done_stream_), "cudaEventRecord(done_event)");
    finish_op(*op, "");
    ch.unsettled.push_back(std::move(op));
    progressed = true;
  }
  while (!ch.queue.empty()) {
    Op& op = *ch.queue.front();
    const std::uint64_t n = ch.next_chunk;
    if (static_cast<std::int64_t>(n - taken) >= static_cast<std::int64_t>(ch.inflight)) break;  // descriptors full
    if (start_send(ch, op)) {
      publish_direct(ch, n);
      progressed = true;
      continue;
    }
    const std::uint64_t bytes = std::min<std::uint64_t>(ch.slot_bytes, op.bytes() - op.offset_);
    std::uint64_t offset = 0;
    if (bytes > 0 && !place_staged(ch, bytes, &offset)) break;  // ring full: wait for the receiver
    progressed = true;
    if (bytes > 0) {
      check(*api_,
            api_->memcpy_async(ch.slots + offset, op.ptr_ + op.offset_, bytes,
                               ipc ? CopyKind::kDeviceToDevice : CopyKind::kDeviceToHost, send_stream_),
            "cudaMemcpyAsync(into ring)");
    }
    ChunkDesc& d = desc_of(ch, n);
    d.msg_seq = ch.next_msg_seq;
    d.tag = op.tag();
    d.total_bytes = op.bytes();
    d.offset = op.offset_;
    d.bytes = bytes;
    d.ring_offset = offset;
    std::memcpy(d.dtype, op.dtype_, kDtypeNameLen);
    d.direct = 0;
    if (ipc) {
      check(*api_, api_->stream_write_value(send_stream_, ch.ready_signal(), n + 1), "stream_write_value(ready)");
      ch.ctl->published.store(n + 1, std::memory_order_release);
    } else {
      Event ev = pool_->take();
      const Status r = api_->event_record(ev, send_stream_);
      if (r != kOk) pool_->give(ev);
      check(*api_, r, "cudaEventRecord(host staging copy)");
      ch.pending.emplace_back(n, ev);  // published once the D2H copy has landed
    }
    ++ch.next_chunk;
    op.offset_ += bytes;
    op.chunks_enqueued_.fetch_add(1);
    if (op.offset_ == op.bytes()) {
      check(*api_, api_->event_record(op.done_event_, send_stream_), "cudaEventRecord(done_event)");
      finish_op(op, "");
      ch.unsettled.push_back(std::move(ch.queue.front()));
      ch.queue.pop_front();
      ++ch.next_msg_seq;
    }
  }
  return progressed;
}

// ---------------------------------------------------------------------------
// Receiving
// ---------------------------------------------------------------------------

// The first chunk of a message: give it to the earliest posted receive of its
// tag. False when none is posted yet (the chunk stays in the ring).
bool Engine::take_receive(Channel& ch, const ChunkDesc& d) {
  auto it = ch.queue.begin();
  while (it != ch.queue.end() && (*it)->tag() != d.tag) ++it;
  if (it == ch.queue.end()) return false;
  std::shared_ptr<Op> op = *it;
  ch.queue.erase(it);
  ch.msg_offset = 0;
  if (op->bytes() != d.total_bytes || std::strncmp(op->dtype_, d.dtype, kDtypeNameLen) != 0) {
    Msg os;
    os << "rank " << rank_ << ": size/dtype mismatch: receive from peer " << ch.peer << " (tag " << d.tag
       << ") expects " << op->bytes() << " bytes of " << op->dtype_ << ", but the peer sent " << d.total_bytes
       << " bytes of " << d.dtype << (d.direct ? " (zero-copy)" : "") << "; the message was discarded";
    finish_op(*op, os.str());
    ch.discarding = true;
  } else {
    ch.current = op;
    check(*api_, api_->stream_wait_event(recv_stream_, op->ready_event_), "cudaStreamWaitEvent(ready_event)");
  }
  return true;
}

void Engine::copy_direct(Channel& ch, const ChunkDesc& d) {
  char* src = nullptr;
  try {
    src = open_peer_buffer(ch, d);
  } catch (const std::exception& e) {
    // Only this receive fails: the message is consumed without a copy.
    finish_op(*ch.current, "rank " + std::to_string(rank_) + ": zero-copy receive from peer " +
                               std::to_string(ch.peer) + " (tag " + std::to_string(d.tag) +
                               ") could not map the sender's buffer: " + e.what() +
                               " (set direct_min_bytes=0 on the sender to disable zero-copy)");
    ch.current.reset();
    ch.discarding = true;
    return;
  }
  check(*api_,
        api_->memcpy_async(ch.current->ptr_, src + d.src_offset, d.bytes, CopyKind::kDeviceToDevice, recv_stream_),
        "cudaMemcpyAsync(from sender buffer)");
  bump(&EngineStats::zero_copy_recvs);
}

bool Engine::progress_recv(Channel& ch) {
  bool progressed = retire_pending(ch);
  progressed |= retire_closing(ch);
  progressed |= serve_retire_requests(ch);
  const bool ipc = ch.staging == Staging::kIpc;
  while (true) {
    const std::uint64_t n = ch.next_chunk;
    if (!reached(ch.ctl->published.load(std::memory_order_acquire), n + 1)) break;  // nothing new
    ChunkDesc d = desc_of(ch, n);
    d.dtype[kDtypeNameLen - 1] = '\0';
    const bool in_message = ch.current != nullptr || ch.discarding;
    const bool direct = d.direct != 0;
    const bool bad_staged =
        !direct && (d.bytes > ch.slot_bytes || d.ring_offset % kChunkAlignment != 0 ||
                    d.ring_offset > ch.ring_bytes || d.bytes > ch.ring_bytes - d.ring_offset);
    if (d.msg_seq != ch.next_msg_seq || bad_staged || d.offset + d.bytes > d.total_bytes ||
        d.offset != (in_message ? ch.msg_offset : 0) ||
        (direct && (!ipc || in_message || d.bytes != d.total_bytes || d.export_slot >= ch.mapped.size() ||
                    d.export_gen == 0 ||
                    (ch.mapped[d.export_slot].ptr != nullptr && ch.mapped[d.export_slot].gen != d.export_gen)))) {
      throw std::runtime_error("protocol error on channel from peer " + std::to_string(ch.peer) + ": chunk " +
                               std::to_string(n - ch.base) + " has message " + std::to_string(d.msg_seq) +
                               " offset " + std::to_string(d.offset) + ", expected message " +
                               std::to_string(ch.next_msg_seq) + " offset " +
                               std::to_string(in_message ? ch.msg_offset : 0));
    }
    if (!in_message && !take_receive(ch, d)) break;
    if (ipc) wait_peer_signal(ch, recv_stream_, ch.ready_signal(), n + 1);
    if (ch.current != nullptr && d.bytes > 0 && direct) {
      copy_direct(ch, d);
    } else if (ch.current != nullptr && d.bytes > 0) {
      check(*api_,
            api_->memcpy_async(ch.current->ptr_ + d.offset, ch.slots + d.ring_offset, d.bytes,
                               ipc ? CopyKind::kDeviceToDevice : CopyKind::kHostToDevice, recv_stream_),
            "cudaMemcpyAsync(out of ring)");
    }
    if (ipc) {
      check(*api_, api_->stream_write_value(recv_stream_, ch.freed_signal(), n + 1), "stream_write_value(freed)");
      ch.ctl->taken.store(n + 1, std::memory_order_release);
    } else {
      Event ev = pool_->take();
      const Status r = api_->event_record(ev, recv_stream_);
      if (r != kOk) pool_->give(ev);
      check(*api_, r, "cudaEventRecord(host staging copy)");
      ch.pending.emplace_back(n, ev);  // taken once the H2D copy has finished reading the ring
    }
    ++ch.next_chunk;
    ch.msg_offset = d.offset + d.bytes;
    progressed = true;
    if (ch.current != nullptr) ch.current->chunks_enqueued_.fetch_add(1);
    if (ch.msg_offset == d.total_bytes) {
      if (ch.current != nullptr) {
        if (!direct) bump(&EngineStats::staged_recvs);
        check(*api_, api_->event_record(ch.current->done_event_, recv_stream_), "cudaEventRecord(done_event)");
        finish_op(*ch.current, "");
        ch.unsettled.push_back(ch.current);
      }
      ch.current.reset();
      ch.discarding = false;
      ch.msg_offset = 0;
      ++ch.next_msg_seq;
    }
  }
  return progressed;
}

// ---------------------------------------------------------------------------
// The worker
// ---------------------------------------------------------------------------

bool Engine::has_pending_work(const Channel& ch) const {
  // (exports_retiring: poll for the receiver's unmap, so that the keep-alive goes promptly)
  return !ch.queue.empty() || !ch.pending.empty() || !ch.awaiting.empty() || ch.current != nullptr ||
         ch.discarding || !ch.closing.empty() || ch.exports_retiring > 0;
}

void Engine::finish_op(Op& op, const std::string& failure) {
  if (failure.empty()) {
    op.request_.complete();
  } else {
    op.request_.fail(failure);
  }
  if (op.keepalive_ != nullptr) released_.push_back(std::move(op.keepalive_));
}

void Engine::fail_channel(Channel& ch, const std::string& why) {
  for (auto& op : ch.queue) finish_op(*op, why + " [" + op->describe() + "]");
  ch.queue.clear();
  if (ch.current != nullptr) finish_op(*ch.current, why + " [" + ch.current->describe() + "]");
  ch.current.reset();
  ch.discarding = false;
  for (auto& entry : ch.awaiting) finish_op(*entry.second, why + " [" + entry.second->describe() + "]");
  ch.awaiting.clear();
}

// While a channel has work outstanding, its peer's process is checked every
// kLivenessPeriod. A dead peer may have left a signal write enqueued but never
// run: the counter our streams wait on is set from the host to the highest
// value they await (releasing them), and the channel's ops fail naming it.
bool Engine::check_peer_alive(Channel& ch) {
  if (!ch.dead.empty()) {
    if (ch.queue.empty() && ch.current == nullptr && ch.awaiting.empty()) return false;
    fail_channel(ch, ch.dead);
    return true;
  }
  const auto now = Clock::now();
  if (now < ch.next_liveness_check) return false;
  ch.next_liveness_check = now + kLivenessPeriod;
  while (!ch.unsettled.empty() &&
         finished(*api_, api_->event_query(ch.unsettled.front()->done_event_), "cudaEventQuery(done_event)")) {
    ch.unsettled.pop_front();
  }
  if (!has_pending_work(ch) && ch.unsettled.empty()) return false;
  const std::string reason = peer_dead_reason(ch.peer_pid);
  if (reason.empty()) return false;
  Msg os;
  os << "rank " << rank_ << ": peer " << ch.peer << " (pid " << ch.peer_pid << ") died (" << reason
     << ") with transfers in flight on channel " << (ch.outgoing ? rank_ : ch.peer) << "->"
     << (ch.outgoing ? ch.peer : rank_);
  ch.dead = os.str();
  ch.status_dead.store(true);
  bump(&EngineStats::peers_died);
  // Fail first, release the streams after: an op whose stream is released
  // must already say it failed when its done event fires.
  for (auto& op : ch.unsettled) op->poison(ch.dead);
  ch.unsettled.clear();
  fail_channel(ch, ch.dead);
  if (ch.wait_any && ch.signals != nullptr) {
    std::uint64_t* signal = ch.outgoing ? ch.freed_signal() : ch.ready_signal();
    const Status r = api_->set_value(signal, ch.wait_target);
    if (r != kOk) (void)api_->error_text(r);  // the peer's memory may be gone with it: close() then leaks
  }
  return true;
}

bool Engine::worker_round() {
  bool progressed = false;
  for (Channel* ch : active_) {
    if (ch->dead.empty()) progressed |= ch->outgoing ? progress_send(*ch) : progress_recv(*ch);
    progressed |= check_peer_alive(*ch);
    while (ch->unsettled.size() > 64 &&  // keep the pool's events coming back during a long burst
           finished(*api_, api_->event_query(ch->unsettled.front()->done_event_), "cudaEventQuery(done_event)")) {
      ch->unsettled.pop_front();
    }
    ch->status_next_chunk.store(ch->next_chunk, std::memory_order_relaxed);
    ch->status_queued.store(ch->queue.size(), std::memory_order_relaxed);
  }
  return progressed;
}

void Engine::worker_main() {
  std::string start_error;
  try {
    check(*api_, api_->set_device(device_), "cudaSetDevice");
  } catch (const std::exception& e) {
    start_error = "rank " + std::to_string(rank_) + ": comm worker could not start: " + e.what();
  }
  auto idle_since = Clock::now();
  std::uint64_t seen_posts = 0;
  while (true) {
    std::string error;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (!start_error.empty() && engine_error_.empty()) engine_error_ = start_error;
      if (stop_) break;
      if (channels_changed_) {
        active_.clear();
        for (auto* map : {&outgoing_, &incoming_}) {
          for (auto& kv : *map) {
            if (kv.second->ready) active_.push_back(kv.second.get());
          }
        }
        channels_changed_ = false;
      }
      for (Channel* ch : active_) {
        while (!ch->inbox.empty()) {
          ch->queue.push_back(std::move(ch->inbox.front()));
          ch->inbox.pop_front();
        }
      }
      if (posted_ != seen_posts) {  // new work: poll fast again
        seen_posts = posted_;
        idle_since = Clock::now();
      }
      error = engine_error_;
    }
    bool progressed = false;
    bool pending = false;
    if (error.empty()) {
      try {
        progressed = worker_round();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu_);
        engine_error_ = "rank " + std::to_string(rank_) + ": comm engine failed: " + e.what();
        continue;
      }
      for (Channel* ch : active_) pending |= has_pending_work(*ch);
    } else {
      for (Channel* ch : active_) {
        for (auto& op : ch->unsettled) {  // enqueued, not done: their waits end too
          if (api_->event_query(op->done_event_) != kOk) op->poison(error);
        }
        ch->unsettled.clear();
        fail_channel(*ch, error);
      }
    }
    // Dropping a tensor can take the Python GIL: never under the engine lock.
    released_.clear();
    if (!progressed && !pending) {
      // Idle; with enqueued ops not yet settled, wake at the liveness period to check their peers.
      bool unsettled = false;
      for (Channel* ch : active_) unsettled |= !ch->unsettled.empty() && ch->dead.empty();
      std::unique_lock<std::mutex> lk(mu_);
      auto wake = [&] { return stop_ || posted_ != seen_posts || channels_changed_; };
      if (unsettled) {
        cv_.wait_for(lk, kLivenessPeriod, wake);
      } else {
        cv_.wait(lk, wake);
      }
      idle_since = Clock::now();
      continue;
    }
    if (progressed) {
      idle_since = Clock::now();
    } else {
      poll_pause(Clock::now() - idle_since);  // waiting on the peer's host or on a host-staged copy
    }
  }
}

}  // namespace dualpipe::cuda
