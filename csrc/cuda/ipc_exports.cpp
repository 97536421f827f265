// CUDA IPC comm engine, host logic: zero-copy exports. The sender's table of
// exported allocations (cached handle + keep-alive per allocation) and the
// receiver's mappings of them, with the shared-memory handshake that lets the
// sender drop a keep-alive only once the receiver has unmapped it. See
// "Keep-alive" in ipc_engine.h.
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/ipc_engine.h"

namespace dualpipe::cuda {

// ---------------------------------------------------------------------------
// Sender
// ---------------------------------------------------------------------------

int Engine::export_for_send(Channel& ch, Op& op) {
  collect_unmapped(ch);
  const std::uint64_t now = ++ch.export_clock;
  ExportEntry* free_entry = nullptr;
  for (ExportEntry& e : ch.exports) {
    if (e.state == ExportEntry::kLive && e.base == op.alloc_base_ && e.alloc_bytes == op.alloc_bytes_) {
      // The same allocation: the entry's keep-alive has held it since its
      // handle was made, so the handle is still valid. Hold the latest
      // storage instead (it keeps the allocation alive just the same, and the
      // older one may go back to the allocator).
      if (op.keepalive_ != nullptr) {
        if (e.keepalive != nullptr) released_.push_back(std::move(e.keepalive));
        e.keepalive = op.keepalive_;
      }
      e.last_use = now;
      return static_cast<int>(&e - ch.exports.data());
    }
    if (e.state == ExportEntry::kFree && free_entry == nullptr) free_entry = &e;
  }
  if (free_entry == nullptr) {
    request_retire(ch);
    bump(&EngineStats::zero_copy_deferred);
    return -1;
  }
  // Not every allocation can be exported (e.g. expandable segments): those
  // sends take the staged path.
  const Status r = api_->ipc_get_mem_handle(&free_entry->handle, op.alloc_base_);
  if (r != kOk) {
    (void)api_->error_text(r);  // clears the error
    return -1;
  }
  bump(&EngineStats::mem_handle_exports);
  ExportEntry& e = *free_entry;
  e.state = ExportEntry::kLive;
  ++e.gen;
  e.base = op.alloc_base_;
  e.alloc_bytes = op.alloc_bytes_;
  e.keepalive = op.keepalive_;
  e.last_use = now;
  return static_cast<int>(&e - ch.exports.data());
}

// Asks the receiver to unmap the least recently used live entry, one at a
// time (the entry it frees serves the next new allocation). Only an entry
// whose chunks the receiver has all consumed qualifies: the receiver handles
// its chunks in order, so when it sees the request it has mapped the entry
// (or never will), and no message in flight refers to it any more.
void Engine::request_retire(Channel& ch) {
  if (ch.exports_retiring > 0) return;
  const std::uint64_t taken = ch.ctl->taken.load(std::memory_order_acquire);
  ExportEntry* lru = nullptr;
  for (ExportEntry& e : ch.exports) {
    if (e.state == ExportEntry::kLive && reached(taken, e.last_chunk + 1) &&
        (lru == nullptr || e.last_use < lru->last_use)) {
      lru = &e;
    }
  }
  if (lru == nullptr) return;
  const auto i = static_cast<std::size_t>(lru - ch.exports.data());
  ch.ctl->retire_gen[i].store(lru->gen, std::memory_order_release);
  ch.ctl->retire_posted.fetch_add(1, std::memory_order_release);
  lru->state = ExportEntry::kRetiring;
  ++ch.exports_retiring;
}

// Retiring entries the receiver has unmapped: drop their keep-alives (after
// mu_, via released_) and free the entries.
void Engine::collect_unmapped(Channel& ch) {
  for (std::size_t i = 0; i < ch.exports.size(); ++i) {
    ExportEntry& e = ch.exports[i];
    if (e.state != ExportEntry::kRetiring) continue;
    if (ch.ctl->unmapped_gen[i].load(std::memory_order_acquire) < e.gen) continue;
    if (e.keepalive != nullptr) released_.push_back(std::move(e.keepalive));
    e.state = ExportEntry::kFree;
    e.base = nullptr;
    e.alloc_bytes = 0;
    e.handle = IpcMemHandle{};
    --ch.exports_retiring;
    bump(&EngineStats::exports_released);
  }
}

// At close. peer_unmapped: the receiver has closed every mapping (detached)
// or is gone; otherwise it may still map them, and the keep-alives stay with
// the engine rather than letting the allocator free mapped memory.
void Engine::release_keepalives(Channel& ch, bool peer_unmapped) {
  for (ExportEntry& e : ch.exports) {
    if (e.keepalive != nullptr) (peer_unmapped ? released_ : abandoned_keepalives_).push_back(std::move(e.keepalive));
    if (e.state != ExportEntry::kFree && peer_unmapped) bump(&EngineStats::exports_released);
    e = ExportEntry{};
  }
  ch.exports_retiring = 0;
}

// ---------------------------------------------------------------------------
// Receiver
// ---------------------------------------------------------------------------

char* Engine::open_peer_buffer(Channel& ch, const ChunkDesc& d) {
  PeerMapping& m = ch.mapped[d.export_slot];
  if (m.ptr != nullptr) return m.ptr;  // progress_recv checked that it is this generation
  void* p = nullptr;
  check(*api_, api_->ipc_open_mem_handle(&p, d.src_handle), "cudaIpcOpenMemHandle(sender buffer)");
  bump(&EngineStats::peer_mappings_opened);
  m = PeerMapping{static_cast<char*>(p), d.export_gen};
  return m.ptr;
}

// The sender's retire requests: a mapped entry is closed once an event
// recorded after the copies reading it has fired (retire_closing), never with
// a host wait under the engine lock; one never mapped here (its message was
// discarded, or the open failed) is acknowledged at once.
bool Engine::serve_retire_requests(Channel& ch) {
  if (ch.ctl == nullptr || ch.mapped.empty()) return false;
  const std::uint64_t posted = ch.ctl->retire_posted.load(std::memory_order_acquire);
  if (posted == ch.retire_seen) return false;
  ch.retire_seen = posted;
  for (std::size_t i = 0; i < ch.mapped.size(); ++i) {
    const std::uint64_t gen = ch.ctl->retire_gen[i].load(std::memory_order_acquire);
    if (gen <= ch.retire_handled[i]) continue;
    PeerMapping& m = ch.mapped[i];
    if (m.ptr != nullptr && m.gen != gen) {
      throw std::runtime_error("protocol error on channel from peer " + std::to_string(ch.peer) + ": export entry " +
                               std::to_string(i) + " retired at generation " + std::to_string(gen) +
                               " while generation " + std::to_string(m.gen) + " is mapped");
    }
    if (m.ptr == nullptr) {
      ch.ctl->unmapped_gen[i].store(gen, std::memory_order_release);
    } else {
      PendingClose pc{m.ptr, pool_->take(), static_cast<int>(i), gen};
      const Status r = api_->event_record(pc.after, recv_stream_);
      if (r != kOk) pool_->give(pc.after);
      check(*api_, r, "cudaEventRecord(unmap)");
      ch.closing.push_back(pc);
      m = PeerMapping{};
    }
    ch.retire_handled[i] = gen;
  }
  return true;
}

bool Engine::retire_closing(Channel& ch) {
  bool progressed = false;
  while (!ch.closing.empty()) {
    PendingClose& pc = ch.closing.front();
    if (!finished(*api_, api_->event_query(pc.after), "cudaEventQuery(unmap)")) break;
    pool_->give(pc.after);
    check(*api_, api_->ipc_close_mem_handle(pc.ptr), "cudaIpcCloseMemHandle(sender buffer)");
    bump(&EngineStats::peer_mappings_closed);
    ch.ctl->unmapped_gen[pc.slot].store(pc.gen, std::memory_order_release);
    ch.closing.erase(ch.closing.begin());
    progressed = true;
  }
  return progressed;
}

// At close, with the streams idle: every mapping of the sender's memory goes,
// and the sender is told per entry (kDetached then covers all of them).
void Engine::close_mappings(Channel& ch) {
  auto unmapped = [&](std::size_t i, std::uint64_t gen) {
    bump(&EngineStats::peer_mappings_closed);
    if (ch.ctl != nullptr) ch.ctl->unmapped_gen[i].store(gen, std::memory_order_release);
  };
  for (const PendingClose& pc : ch.closing) {
    pool_->give(pc.after);
    api_->ipc_close_mem_handle(pc.ptr);
    unmapped(static_cast<std::size_t>(pc.slot), pc.gen);
  }
  ch.closing.clear();
  for (std::size_t i = 0; i < ch.mapped.size(); ++i) {
    PeerMapping& m = ch.mapped[i];
    if (m.ptr == nullptr) continue;
    api_->ipc_close_mem_handle(m.ptr);
    unmapped(i, m.gen);
    m = PeerMapping{};
  }
}

}  // namespace dualpipe::cuda
