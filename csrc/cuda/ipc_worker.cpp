// CUDA IPC comm engine, host logic: the worker thread that moves chunks
// through every channel. Teardown is in ipc_teardown.cpp; see ipc_engine.h
// for the protocol.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/liveness.h"
#include "common/poll.h"
#include "cuda/ipc_engine.h"
#include "common/msg.h"

namespace dualpipe::cuda {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Sending
// ---------------------------------------------------------------------------

bool Engine::retire_pending(Channel& ch) {
  bool progressed = false;
  while (!ch.pending.empty()) {
    const std::uint64_t n = ch.pending.front();
    const int slot = static_cast<int>(n % ch.num_slots);
    if (!finished(*api_, api_->event_query(ch.local_events[slot]), "cudaEventQuery(host staging copy)")) break;
    (ch.outgoing ? ch.ctl->published : ch.ctl->freed).store(n + 1, std::memory_order_release);
    ch.pending.pop_front();
    progressed = true;
  }
  return progressed;
}

// First chunk of a send: the comm stream waits for the producer, and a large
// send from an exportable allocation goes zero-copy. Returns op.direct_.
bool Engine::start_send_locked(Channel& ch, Op& op) {
  if (op.started_) return op.direct_;
  check(*api_, api_->stream_wait_event(send_stream_, op.ready_event_), "cudaStreamWaitEvent(ready_event)");
  op.started_ = true;
  if (ch.staging == Staging::kIpc && options_.direct_min_bytes > 0 && op.bytes() >= options_.direct_min_bytes &&
      op.alloc_base_ != nullptr) {
    op.export_slot_ = export_for_send_locked(ch, op);  // -1: no entry, or not exportable: staged
    op.direct_ = op.export_slot_ >= 0;
  }
  op.zero_copy_.store(op.direct_, std::memory_order_release);
  ++(op.direct_ ? stats_.zero_copy_sends : stats_.staged_sends);
  return op.direct_;
}

// A zero-copy send: the chunk descriptor carries the handle, not data.
void Engine::publish_direct_locked(Channel& ch, std::uint64_t n) {
  Op& op = *ch.queue.front();
  const int slot = static_cast<int>(n % ch.num_slots);
  // "the source is ready": recorded after the producer wait
  check(*api_, api_->event_record(ch.local_events[slot], send_stream_), "cudaEventRecord(ready_event)");
  ChunkDesc& d = ch.ctl->desc[slot];
  d.msg_seq = ch.next_msg_seq;
  d.tag = op.tag();
  d.total_bytes = op.bytes();
  d.offset = 0;
  d.bytes = op.bytes();
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
  if (ch.exports_retiring > 0) collect_unmapped_locked(ch);
  const bool ipc = ch.staging == Staging::kIpc;
  const auto S = static_cast<std::uint64_t>(ch.num_slots);
  // Zero-copy sends whose chunk the receiver has consumed: its free event
  // follows its copy out of our buffer, so our op is done once that event is.
  // (Should the receiver already have re-recorded the event for a later chunk,
  // the wait binds to that later record: later on the same stream, so still safe.)
  const std::uint64_t freed_now = ch.ctl->freed.load(std::memory_order_acquire);
  while (!ch.awaiting.empty() && ch.awaiting.front().first < freed_now) {
    const std::uint64_t n = ch.awaiting.front().first;
    std::shared_ptr<Op> op = std::move(ch.awaiting.front().second);
    ch.awaiting.pop_front();
    check(*api_, api_->stream_wait_event(send_stream_, ch.peer_events[n % S]), "cudaStreamWaitEvent(free_event)");
    check(*api_, api_->event_record(op->done_event_, send_stream_), "cudaEventRecord(done_event)");
    finish_op_locked(*op, "");
    progressed = true;
  }
  while (!ch.queue.empty()) {
    Op& op = *ch.queue.front();
    const std::uint64_t n = ch.next_chunk;
    if (n >= ch.ctl->freed.load(std::memory_order_acquire) + S) break;  // ring full: wait for the receiver
    const int slot = static_cast<int>(n % S);
    progressed = true;
    if (start_send_locked(ch, op)) {
      publish_direct_locked(ch, n);
      continue;
    }
    // The receiver has enqueued the drain of chunk n - S; wait for it on the
    // device before overwriting the slot (host staging: freed means drained).
    if (ipc && n >= S) {
      check(*api_, api_->stream_wait_event(send_stream_, ch.peer_events[slot]), "cudaStreamWaitEvent(free_event)");
    }
    const std::uint64_t bytes = std::min<std::uint64_t>(ch.slot_bytes, op.bytes() - op.offset_);
    char* slot_ptr = ch.slots + static_cast<std::size_t>(slot) * ch.slot_bytes;
    if (bytes > 0) {
      check(*api_,
            api_->memcpy_async(slot_ptr, op.ptr_ + op.offset_, bytes,
                               ipc ? CopyKind::kDeviceToDevice : CopyKind::kDeviceToHost, send_stream_),
            "cudaMemcpyAsync(into ring)");
    }
    check(*api_, api_->event_record(ch.local_events[slot], send_stream_), "cudaEventRecord(ready_event)");
    ChunkDesc& d = ch.ctl->desc[slot];
    d.msg_seq = ch.next_msg_seq;
    d.tag = op.tag();
    d.total_bytes = op.bytes();
    d.offset = op.offset_;
    d.bytes = bytes;
    std::memcpy(d.dtype, op.dtype_, kDtypeNameLen);
    d.direct = 0;
    if (ipc) {
      ch.ctl->published.store(n + 1, std::memory_order_release);
    } else {
      ch.pending.push_back(n);  // published once the D2H copy has landed
    }
    ++ch.next_chunk;
    op.offset_ += bytes;
    op.chunks_enqueued_.fetch_add(1);
    if (op.offset_ == op.bytes()) {
      check(*api_, api_->event_record(op.done_event_, send_stream_), "cudaEventRecord(done_event)");
      finish_op_locked(op, "");
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
bool Engine::take_receive_locked(Channel& ch, const ChunkDesc& d) {
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
    finish_op_locked(*op, os.str());
    ch.discarding = true;
  } else {
    ch.current = op;
    check(*api_, api_->stream_wait_event(recv_stream_, op->ready_event_), "cudaStreamWaitEvent(ready_event)");
  }
  return true;
}

void Engine::copy_direct_locked(Channel& ch, const ChunkDesc& d) {
  char* src = nullptr;
  try {
    src = open_peer_buffer(ch, d);
  } catch (const std::exception& e) {
    // Only this receive fails: the message is consumed without a copy.
    finish_op_locked(*ch.current, "rank " + std::to_string(rank_) + ": zero-copy receive from peer " +
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
  ++stats_.zero_copy_recvs;
}

bool Engine::progress_recv(Channel& ch) {
  bool progressed = retire_pending(ch);
  progressed |= retire_closing(ch);
  progressed |= serve_retire_requests(ch);
  const bool ipc = ch.staging == Staging::kIpc;
  const auto S = static_cast<std::uint64_t>(ch.num_slots);
  while (true) {
    const std::uint64_t n = ch.next_chunk;
    if (ch.ctl->published.load(std::memory_order_acquire) <= n) break;  // nothing new from the sender
    const int slot = static_cast<int>(n % S);
    ChunkDesc d = ch.ctl->desc[slot];
    d.dtype[kDtypeNameLen - 1] = '\0';
    const bool in_message = ch.current != nullptr || ch.discarding;
    const bool direct = d.direct != 0;
    if (d.msg_seq != ch.next_msg_seq || (!direct && d.bytes > ch.slot_bytes) || d.offset + d.bytes > d.total_bytes ||
        d.offset != (in_message ? ch.msg_offset : 0) ||
        (direct && (!ipc || in_message || d.bytes != d.total_bytes || d.export_slot >= ch.mapped.size() ||
                    d.export_gen == 0 ||
                    (ch.mapped[d.export_slot].ptr != nullptr && ch.mapped[d.export_slot].gen != d.export_gen)))) {
      throw std::runtime_error("protocol error on channel from peer " + std::to_string(ch.peer) + ": chunk " +
                               std::to_string(n) + " has message " + std::to_string(d.msg_seq) + " offset " +
                               std::to_string(d.offset) + ", expected message " + std::to_string(ch.next_msg_seq) +
                               " offset " + std::to_string(in_message ? ch.msg_offset : 0));
    }
    if (!in_message && !take_receive_locked(ch, d)) break;
    if (ipc) check(*api_, api_->stream_wait_event(recv_stream_, ch.peer_events[slot]), "cudaStreamWaitEvent(peer)");
    if (ch.current != nullptr && d.bytes > 0 && direct) {
      copy_direct_locked(ch, d);
    } else if (ch.current != nullptr && d.bytes > 0) {
      const char* slot_ptr = ch.slots + static_cast<std::size_t>(slot) * ch.slot_bytes;
      check(*api_,
            api_->memcpy_async(ch.current->ptr_ + d.offset, slot_ptr, d.bytes,
                               ipc ? CopyKind::kDeviceToDevice : CopyKind::kHostToDevice, recv_stream_),
            "cudaMemcpyAsync(out of ring)");
    }
    check(*api_, api_->event_record(ch.local_events[slot], recv_stream_), "cudaEventRecord(free_event)");
    if (ipc) {
      ch.ctl->freed.store(n + 1, std::memory_order_release);
    } else {
      ch.pending.push_back(n);  // freed once the H2D copy has finished reading the slot
    }
    ++ch.next_chunk;
    ch.msg_offset = d.offset + d.bytes;
    progressed = true;
    if (ch.current != nullptr) ch.current->chunks_enqueued_.fetch_add(1);
    if (ch.msg_offset == d.total_bytes) {
      if (ch.current != nullptr) {
        if (!direct) ++stats_.staged_recvs;
        check(*api_, api_->event_record(ch.current->done_event_, recv_stream_), "cudaEventRecord(done_event)");
        finish_op_locked(*ch.current, "");
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

bool Engine::has_pending_work_locked() const {
  for (const auto* map : {&outgoing_, &incoming_}) {
    for (const auto& kv : *map) {
      const Channel& ch = kv.second;
      // (exports_retiring: poll for the receiver's unmap, so that the keep-alive goes promptly)
      if (ch.ready && (!ch.queue.empty() || !ch.pending.empty() || !ch.awaiting.empty() || ch.current != nullptr ||
                       ch.discarding || !ch.closing.empty() || ch.exports_retiring > 0)) {
        return true;
      }
    }
  }
  return false;
}

void Engine::finish_op_locked(Op& op, const std::string& failure) {
  if (failure.empty()) {
    op.request_.complete();
  } else {
    op.request_.fail(failure);
  }
  if (op.keepalive_ != nullptr) released_.push_back(std::move(op.keepalive_));
}

void Engine::fail_all_locked(const std::string& why) {
  for (auto* map : {&outgoing_, &incoming_}) {
    for (auto& kv : *map) {
      Channel& ch = kv.second;
      for (auto& op : ch.queue) finish_op_locked(*op, why + " [" + op->describe() + "]");
      ch.queue.clear();
      if (ch.current != nullptr) finish_op_locked(*ch.current, why + " [" + ch.current->describe() + "]");
      ch.current.reset();
      for (auto& entry : ch.awaiting) finish_op_locked(*entry.second, why + " [" + entry.second->describe() + "]");
      ch.awaiting.clear();
    }
  }
}

void Engine::worker_main() {
  try {
    check(*api_, api_->set_device(device_), "cudaSetDevice");
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lk(mu_);
    engine_error_ = "rank " + std::to_string(rank_) + ": comm worker could not start: " + e.what();
  }
  auto idle_since = Clock::now();
  while (true) {
    bool progressed = false;
    // Buffers whose last reference may be dropped here: released after mu_
    // (destroying a tensor can take the Python GIL, and a Python thread
    // holding the GIL may be waiting for mu_ in post()).
    std::vector<std::shared_ptr<void>> drop;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stop_) break;
      if (!engine_error_.empty()) {
        fail_all_locked(engine_error_);
        drop.swap(released_);
        lk.unlock();
        drop.clear();
        lk.lock();
        cv_.wait(lk, [this] { return stop_; });
        break;
      }
      try {
        for (auto& kv : outgoing_) {
          if (kv.second.ready) progressed |= progress_send(kv.second);
        }
        for (auto& kv : incoming_) {
          if (kv.second.ready) progressed |= progress_recv(kv.second);
        }
      } catch (const std::exception& e) {
        engine_error_ = "rank " + std::to_string(rank_) + ": comm engine failed: " + e.what();
        continue;
      }
      drop.swap(released_);
      if (!progressed && !has_pending_work_locked() && drop.empty()) {
        cv_.wait(lk, [this] { return stop_ || has_pending_work_locked(); });
        idle_since = Clock::now();
        continue;
      }
    }
    if (progressed) {
      idle_since = Clock::now();
    } else {
      backoff(Clock::now() - idle_since);  // waiting on the peer or on a host-staged copy
    }
  }
}

}  // namespace dualpipe::cuda
