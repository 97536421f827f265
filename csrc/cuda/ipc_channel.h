// One directed channel of the CUDA IPC engine: its shared control block (the
// wire layout both processes read) and each side's private state. See
// ipc_engine.h for the protocol.
#pragma once

#include <atomic>
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
//! Most sender allocations a receiver keeps mapped per channel (max_peer_mappings).
inline constexpr int kMaxExports = 64;
inline constexpr int kDtypeNameLen = 24;
inline constexpr std::uint64_t kMagic = 0x31304350494B5044ull;  // "DPKIPC01" read as little-endian bytes
inline constexpr std::uint32_t kVersion = 4;
//! Device rings are rounded up to this: a smaller cudaMalloc may be carved
//! from a larger block whose IPC handle maps the block's start.
inline constexpr std::uint64_t kRingAlignment = 2u << 20;

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
// name (ready_events: once by the sender before sender_attached).
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
  std::uint64_t slot_bytes;
  IpcMemHandle ring_handle;
  IpcEventHandle free_events[kMaxSlots];
  IpcEventHandle ready_events[kMaxSlots];
  alignas(64) std::atomic<std::int32_t> sender_pid;
  std::atomic<std::uint32_t> sender_attached;
  alignas(64) std::atomic<std::uint64_t> published;
  alignas(64) std::atomic<std::uint64_t> freed;
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
  alignas(64) ChunkDesc desc[kMaxSlots];
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
  Event after = nullptr;  // recorded on the receive stream after the last copy from ptr
  int slot = 0;
  std::uint64_t gen = 0;
};

struct Channel {
  int peer = -1;
  bool outgoing = false;
  Staging staging = Staging::kIpc;
  int num_slots = 0;
  std::uint64_t slot_bytes = 0;
  ShmSegment segment;      // the control block (+ host ring); its name is unlinked once both sides mapped it
  CtlBlock* ctl = nullptr;  // at segment.data()
  char* slots = nullptr;    // device ring (own or IPC-mapped) or host ring inside the segment
  bool slots_device_owned = false;
  bool slots_ipc_opened = false;
  bool host_registered = false;
  Event local_events[kMaxSlots] = {};  // outgoing: ready events; incoming: free events
  Event peer_events[kMaxSlots] = {};   // opened from the peer (ipc staging only)
  std::uint64_t next_chunk = 0;
  std::uint64_t next_msg_seq = 0;
  std::deque<std::shared_ptr<Op>> queue;  // outgoing: sends in wire order; incoming: posted receives
  std::deque<std::uint64_t> pending;      // host staging: chunks whose local copy is still running
  // outgoing: zero-copy sends published as chunk `first`, waiting for the receiver's copy
  std::deque<std::pair<std::uint64_t, std::shared_ptr<Op>>> awaiting;
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
  bool ready = false;            // rendezvous finished, usable
};

}  // namespace dualpipe::cuda
