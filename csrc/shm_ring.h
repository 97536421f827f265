// Layout of one directed shared-memory ring (sender -> receiver) and the
// lock-free handshake on it.
//
// Segment layout (all offsets multiples of 64 bytes):
//   RingHeader | slot 0: SlotHeader + slot_bytes data | slot 1 | ... | slot S-1
//
// Protocol. `head` counts chunks the sender has published, `tail` chunks the
// receiver has drained; both only grow (mod 2^32, compared by unsigned
// difference). Each side also keeps the full 64-bit count locally, and chunk n
// lives in slot n % S of that 64-bit n (2^32 is not a multiple of every S). The sender may write chunk n once
// n - tail < S; it fills the slot, then stores head = n + 1 with release
// order. The receiver reads chunk n once head > n (acquire), copies it out,
// then stores tail = n + 1 (release) to give the slot back. So the sender
// fills one slot while the receiver drains another (pipelining), and a slot's
// bytes are never read and written at once.
//
// Sleeping. A side that has spun for a while without progress increments the
// matching *_waiters counter and futex-waits on the 32-bit counter it waits
// for; the other side futex-wakes after a store only when waiters > 0. The
// increment / counter load and the counter store / waiters load are all
// sequentially consistent, so either the waker sees the waiter or the waiter
// sees the new value (no lost wake-up); FUTEX_WAIT also re-checks the value
// atomically. Waits are bounded (a few ms) so liveness is re-checked.
//
// Single copy. A message of at least ChannelConfig::single_copy_min_bytes may
// travel as one descriptor chunk (SlotHeader::kind == kDescriptor, slot data a
// RemoteDescriptor) instead of its payload: the receiver copies the bytes
// straight out of the sender's memory with process_vm_readv (one copy instead
// of two), then releases the slot (tail). The sender keeps its buffer until
// tail has passed the descriptor, which is the acknowledgement. Whether this is
// allowed is decided once by the receiver when it attaches: it reads a known
// word (the magic, at the address the sender recorded in sender_probe_addr)
// out of the sender process and publishes the outcome in `single_copy`
// (ptrace_scope / container policies may forbid the read: then the ring path).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/poll.h"

namespace dualpipe::shm {

inline constexpr std::uint64_t kRingMagic = 0x31676e69726b7064ULL;  // "dpkring1"
inline constexpr std::uint32_t kRingVersion = 2;
inline constexpr std::size_t kCacheLine = 64;
inline constexpr std::size_t kErrorTextBytes = 320;

//! Which side of a ring a process is on.
enum class Side : std::uint32_t { kSender = 0, kReceiver = 1 };

//! Attach state of one side (RingHeader::state[side]).
enum class SideState : std::uint32_t { kAbsent = 0, kAttached = 1, kClosed = 2 };

//! What a slot carries (SlotHeader::kind).
enum class ChunkKind : std::uint32_t { kPayload = 0, kDescriptor = 1 };

//! RingHeader::single_copy: the receiver's verdict on reading the sender's memory.
enum class SingleCopy : std::uint32_t { kUnknown = 0, kPermitted = 1, kUnavailable = 2 };

//! Slot data of a kDescriptor chunk: where the whole message lies in the sender.
struct RemoteDescriptor {
  std::uint64_t address;  //!< the sender's virtual address of byte 0
  std::int32_t pid;       //!< the sender process
  std::uint32_t reserved;
};

//! Per-chunk header, written by the sender before it publishes the slot.
//! Every chunk repeats the message's identity so the receiver can check that
//! chunks arrive in order and belong to the message it is assembling.
struct alignas(kCacheLine) SlotHeader {
  std::uint64_t msg_seq;      //!< 0, 1, 2, ... per ring, one per message
  std::uint64_t nbytes;       //!< whole message size in bytes
  std::uint64_t offset;       //!< byte offset of this chunk in the message
  std::int64_t tag;           //!< the sender's tag
  std::uint64_t chunk_bytes;  //!< bytes of payload in this slot (<= slot_bytes)
  std::int32_t dtype;         //!< caller-defined element type code (checked, not interpreted)
  std::uint32_t kind;         //!< a ChunkKind; a kDescriptor chunk has chunk_bytes == 0
};

struct RingHeader {
  std::atomic<std::uint64_t> magic;  //!< kRingMagic once the header is initialised (release)
  std::uint32_t version;
  std::uint32_t num_slots;
  std::uint64_t slot_bytes;
  std::uint64_t segment_bytes;
  std::int32_t src_rank;
  std::int32_t dst_rank;

  alignas(kCacheLine) std::atomic<std::uint32_t> head;  //!< written by the sender only
  std::atomic<std::uint32_t> head_waiters;              //!< receivers sleeping on head
  alignas(kCacheLine) std::atomic<std::uint32_t> tail;  //!< written by the receiver only
  std::atomic<std::uint32_t> tail_waiters;              //!< senders sleeping on tail

  alignas(kCacheLine) std::atomic<std::int32_t> pid[2];     //!< per Side
  std::atomic<std::uint32_t> state[2];                      //!< per Side, a SideState
  std::atomic<std::uint32_t> error;                         //!< 0 ok, 1 being written, 2 set
  char error_text[kErrorTextBytes];                         //!< valid once error == 2

  alignas(kCacheLine) std::atomic<std::uint64_t> sender_probe_addr;  //!< &magic in the sender's mapping (0: none)
  std::atomic<std::uint32_t> single_copy;                            //!< a SingleCopy, written by the receiver
};

static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "ring atomics must be lock-free");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "futex word layout");

//! Bytes of a ring segment with the given geometry.
std::size_t ring_segment_bytes(std::uint32_t num_slots, std::uint64_t slot_bytes);

//! A view of a mapped ring (does not own the memory).
class RingView {
 public:
  RingView() = default;
  //! Initialise a fresh (zero-filled) segment. Called once, by the creator.
  static RingView initialise(void* base, std::size_t bytes, std::uint32_t num_slots, std::uint64_t slot_bytes,
                             int src_rank, int dst_rank);
  //! Validate and view an initialised segment; throws std::runtime_error on a bad header.
  static RingView attach(void* base, std::size_t bytes);

  RingHeader* header() const { return header_; }
  std::uint32_t num_slots() const { return header_->num_slots; }
  std::uint64_t slot_bytes() const { return header_->slot_bytes; }
  //! Chunk n (a 64-bit count kept by each side; the shared 32-bit counters are its low bits) lives in slot n % S.
  SlotHeader* slot_header(std::uint64_t chunk) const;
  unsigned char* slot_data(std::uint64_t chunk) const;

  //! Record an error for both sides; the first error wins. Thread/process safe.
  void set_error(const std::string& text) const;
  //! The recorded error, or "" if none.
  std::string error() const;

 private:
  RingHeader* header_ = nullptr;
  unsigned char* slots_ = nullptr;
  std::size_t slot_stride_ = 0;
};

//! futex helpers on a 32-bit atomic that may live in shared memory.
//! wait: sleeps while *word == expected, at most timeout_ns; spurious returns allowed.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long timeout_ns);
void futex_wake_all(std::atomic<std::uint32_t>* word);

}  // namespace dualpipe::shm
