// One directed channel of the CUDA IPC engine: its shared control block (the
// wire layout both processes read) and each side's private state. See
// ipc_engine.h for the protocol.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/segment.h"
#include "cuda/device_api.h"

namespace dualpipe::cuda {

inline constexpr int kMaxSlots = 16;
//! Most chunks a sender may have published ahead of the receiver (the descriptor ring; EngineOptions::max_inflight).
inline constexpr int kMaxInflight = 1024;
//! Most sender allocations a receiver keeps mapped per channel (max_peer_mappings).
inline constexpr int kMaxExports = 64;
inline constexpr int kDtypeNameLen = 24;
inline constexpr std::uint64_t kMagic = 0x31304350494B5044ull;  // "DPKIPC01" read as little-endian bytes
inline constexpr std::uint32_t kVersion = 5;
//! Device rings are rounded up to this: a smaller cudaMalloc may be carved
//! from a larger block whose IPC handle maps the block's start.
inline constexpr std::uint64_t kRingAlignment = 2u << 20;
//! Staged chunks start at multiples of this in the ring.
inline constexpr std::uint64_t kChunkAlignment = 256;
//! The device signal block after the ring: `ready` at +0, `freed` at +kSignalStride (own cache lines).
inline constexpr std::uint64_t kSignalStride = 128;
inline constexpr std::uint64_t kSignalBytes = 2 * kSignalStride;

enum class Staging : std::int32_t { kAuto = -1, kIpc = 0, kHost = 1 };

//! Values of CtlBlock::{sender,receiver}_detached.
enum Detach : std::uint32_t {
  kAttached = 0,
  kDetached = 1,   //!< closed every mapping of the peer's memory: the peer may free it
  kAbandoned = 2,  //!< gave up with copies possibly in flight: the peer must leak, not free
};

// Descriptor of the chunk currently held by one slot (written by the sender
// before it publishes the chunk; read by the receiver after it sees it).
struct ChunkDesc {
  std::uint64_t msg_seq;      // message number on this channel, from 0
  std::int64_t tag;           // the sender's tag
  std::uint64_t total_bytes;  // size of the whole message
  std::uint64_t offset;       // byte offset of this chunk in the message
  std::uint64_t bytes;        // bytes in this chunk (<= slot_bytes unless direct)
  std::uint64_t ring_offset;  // staged: where the chunk lies in the ring
  char dtype[kDtypeNameLen];
  std::uint32_t direct;  // 1: zero-copy, the data is at src_handle + src_offset, not in the slot
  std::uint32_t export_slot;  // direct: the sender's export entry of the allocation, < CtlBlock::export_slots
  std::uint64_t src_offset;
  std::uint64_t src_base;    // sender's address of the allocation (for error messages)
  std::uint64_t export_gen;  // direct: which allocation the entry holds (from 1, +1 at each reuse)
  IpcMemHandle src_handle;
};

// Lives at the start of the receiver-created shared segment. Fields above the
// atomics are written once by the receiver before it publishes the segment
// name. Chunk numbers start at counter_base and wrap around 2^64 (compared
// with reached()). Host counters (here) order the hosts; device counters (the
// signal block in the ring allocation) order the streams.
struct CtlBlock {
  std::uint64_t magic;
  std::uint32_t version;
  std::int32_t staging;  // Staging::kIpc or kHost
  std::int32_t num_slots;
  std::int32_t src_rank;
  std::int32_t dst_rank;
  std::int32_t receiver_pid;
  std::int32_t receiver_device;
  std::int32_t export_slots;  // the receiver's max_peer_mappings: export entries the sender may use
  std::int32_t inflight;      // descriptors in desc[]: chunks published ahead of the receiver
  std::uint64_t slot_bytes;   // the largest staged chunk
  std::uint64_t ring_bytes;   // num_slots * slot_bytes
  std::uint64_t signal_offset;  // ipc: the signal block's offset in the ring allocation
  std::uint64_t counter_base;   // the first chunk number (and the signals' initial value)
  IpcMemHandle ring_handle;
  alignas(64) std::atomic<std::int32_t> sender_pid;
  std::atomic<std::uint32_t> sender_attached;
  // published (sender): descriptors of chunks base..published-1 are written
  // and (ipc) their copies and ready signals enqueued / (host) copies landed.
  alignas(64) std::atomic<std::uint64_t> published;
  // taken (receiver): chunks base..taken-1 are consumed: (ipc) their drains
  // and freed signals enqueued / (host) drains finished.
  alignas(64) std::atomic<std::uint64_t> taken;
  alignas(64) std::atomic<std::uint32_t> sender_detached;
  std::atomic<std::uint32_t> receiver_detached;
  // Zero-copy exports (see "Keep-alive" in ipc_engine.h). retire_gen[i]
  // (sender): unmap generation <= g of export entry i, which no unconsumed
  // chunk references; retire_posted (sender) counts those requests, so the
  // receiver scans only when it moved. unmapped_gen[i] (receiver): generation
  // g of entry i is no longer mapped here; the sender may now drop its
  // keep-alive of that allocation and reuse the entry.
  alignas(64) std::atomic<std::uint64_t> retire_posted;
  std::atomic<std::uint64_t> retire_gen[kMaxExports];
  alignas(64) std::atomic<std::uint64_t> unmapped_gen[kMaxExports];
  alignas(64) ChunkDesc desc[kMaxInflight];  // chunk n at desc[(n - counter_base) % inflight]
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared-memory counters need lock-free 64-bit atomics");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "shared-memory flags need lock-free 32-bit atomics");

inline constexpr std::size_t kPage = 4096;
//! Where a host-staged ring starts in the segment: after the control block.
inline constexpr std::size_t ring_offset() { return (sizeof(CtlBlock) + kPage - 1) / kPage * kPage; }

class Op;

// Sender: one allocation exported for zero-copy sends. While live, the
// keep-alive holds the caller's storage, so the allocation cannot be freed
// (and its address cannot come back as another allocation) while the
// receiver may map it; the cached handle is valid exactly as long.
struct ExportEntry {
  enum State { kFree, kLive, kRetiring };  // kRetiring: the receiver was asked to unmap it
  State state = kFree;
  char* base = nullptr;
  std::uint64_t alloc_bytes = 0;  // with base, the allocation's identity (0: unknown)
  IpcMemHandle handle{};
  std::uint64_t gen = 0;          // generation of the current (or last) allocation in this entry
  std::uint64_t last_chunk = 0;   // the last chunk published that references it
  std::uint64_t last_use = 0;     // LRU clock
  std::shared_ptr<void> keepalive;
};

// Receiver: the sender's export entry i, mapped here (ptr null: not mapped).
struct PeerMapping {
  char* ptr = nullptr;
  std::uint64_t gen = 0;
};

// A mapping the sender retired, closed once the copies that read it are done;
// then unmapped_gen[slot] = gen tells the sender.
struct PendingClose {
  char* ptr = nullptr;
  Event after = nullptr;  // (from the event pool) recorded on the receive stream after the last copy from ptr
  int slot = 0;
  std::uint64_t gen = 0;
};

// Private state of one side of a channel. Fields are the worker thread's
// once the channel is ready, except `inbox` (the engine lock) and the status_*
// mirrors (atomics, read by channel_status).
struct Channel {
  int peer = -1;
  bool outgoing = false;
  Staging staging = Staging::kIpc;
  int num_slots = 0;
  std::uint64_t slot_bytes = 0;
  std::uint64_t ring_bytes = 0;
  std::uint64_t inflight = 0;
  std::uint64_t base = 0;   // counter_base
  int peer_pid = 0;
  ShmSegment segment;      // the control block (+ host ring); its name is unlinked once both sides mapped it
  CtlBlock* ctl = nullptr;  // at segment.data()
  char* slots = nullptr;    // device ring (own or IPC-mapped) or host ring inside the segment
  char* signals = nullptr;  // ipc: the signal block (ready, freed) in the ring allocation
  bool slots_device_owned = false;
  bool slots_ipc_opened = false;
  bool host_registered = false;
  std::uint64_t next_chunk = 0;
  std::uint64_t next_msg_seq = 0;
  std::deque<std::shared_ptr<Op>> inbox;  // posted, not yet seen by the worker (engine lock)
  std::deque<std::shared_ptr<Op>> queue;  // outgoing: sends in wire order; incoming: posted receives
  // host staging: chunks whose local copy is still running, with the pool event recorded after it
  std::deque<std::pair<std::uint64_t, Event>> pending;
  // outgoing: zero-copy sends published as chunk `first`, waiting for the receiver to take it
  std::deque<std::pair<std::uint64_t, std::shared_ptr<Op>>> awaiting;
  // ops whose copies are enqueued but may not have run: checked (done event)
  // only at the liveness period, so that a peer dying under them fails them
  std::deque<std::shared_ptr<Op>> unsettled;
  // outgoing: staged chunks still occupying the ring: (chunk, absolute start byte)
  std::deque<std::pair<std::uint64_t, std::uint64_t>> staged;
  std::uint64_t next_abs = 0;      // outgoing: absolute ring position of the next staged chunk
  std::uint64_t freed_waited = 0;  // outgoing, ipc: the send stream already waits for freed >= this
  bool freed_wait_any = false;
  // the highest value our streams wait for on the counter the peer writes
  // (sender: freed; receiver: ready), to release them should the peer die
  std::uint64_t wait_target = 0;
  bool wait_any = false;
  // outgoing: allocations exported for zero-copy sends (CtlBlock::export_slots entries)
  std::vector<ExportEntry> exports;
  std::uint64_t export_clock = 0;
  int exports_retiring = 0;
  // incoming: mapped[i] is the sender's export entry i; retire requests handled so far
  std::vector<PeerMapping> mapped;
  std::vector<std::uint64_t> retire_handled;
  std::uint64_t retire_seen = 0;
  std::vector<PendingClose> closing;
  std::shared_ptr<Op> current;  // incoming: receive being filled
  std::uint64_t msg_offset = 0;  // incoming: next expected byte offset in the current message
  bool discarding = false;       // incoming: draining a mismatched message
  bool ready = false;            // rendezvous finished, usable (set under the engine lock)
  std::string dead;              // the peer died: why (the worker's; then every op on the channel fails)
  std::chrono::steady_clock::time_point next_liveness_check{};
  std::atomic<std::uint64_t> status_next_chunk{0};
  std::atomic<std::uint64_t> status_queued{0};
  std::atomic<bool> status_dead{false};

  std::uint64_t* ready_signal() const { return reinterpret_cast<std::uint64_t*>(signals); }
  std::uint64_t* freed_signal() const { return reinterpret_cast<std::uint64_t*>(signals + kSignalStride); }
};

}  // namespace dualpipe::cuda
