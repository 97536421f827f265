// CUDA IPC comm engine: point-to-point transfers between processes on one host.
//
// No torch and no pybind11 here: the engine sees raw device pointers, byte
// counts and cudaStream_t only (csrc/cuda/cuda_bindings.cpp adapts tensors).
//
// Topology. For every directed pair (sender S -> receiver R) there is one
// channel. The receiver owns it: a control block in a POSIX shared-memory
// segment (counters, chunk descriptors, IPC handles) plus a ring of
// `num_slots` slots of `slot_bytes` each. The ring is device memory exported
// with cudaIpcGetMemHandle ("ipc" staging) or, where IPC is not possible,
// pinned host memory inside the same shared segment ("host" staging: the
// sender copies D2H into the slot, the receiver H2D out of it).
//
// Protocol (chunk n of the channel uses slot n % S; both counters are
// monotonic and live in the control block):
//   published  written by the sender:   chunks 0..published-1 are in the ring
//                                        (ipc: their copies are *enqueued* and
//                                        ready_event[slot] recorded after them;
//                                        host: their copies have finished).
//   freed      written by the receiver: chunks 0..freed-1 have been drained
//                                        (ipc: the drain is enqueued and
//                                        free_event[slot] recorded after it;
//                                        host: the drain has finished).
// Sender, chunk n: wait (host, worker thread) until n < freed + S; in ipc mode
//   its comm stream then waits on the receiver's free_event[slot] (GPU-side),
//   copies into the slot, records ready_event[slot], writes desc[slot] and
//   bumps `published` (release).
// Receiver, chunk n: wait until published > n; read desc[slot]; match the
//   message's first chunk with the earliest posted receive of the same tag;
//   in ipc mode its comm stream waits on the sender's ready_event[slot], copies
//   out into the caller's buffer, records free_event[slot] and bumps `freed`.
// Why host counters as well as IPC events: cudaStreamWaitEvent binds to the
// event's most recent record *at the time of the call*; the counters tell the
// waiting side that the record for this very chunk has been made, so it never
// waits on a stale record. An event slot is re-recorded only after the peer
// has enqueued its wait on the previous record (the counters guarantee it),
// so the events can be reused round after round. No host thread ever waits
// for GPU work in ipc mode; the comm stream only runs copies (copy engines,
// no SMs). Large messages are split into slot-sized chunks and pipelined
// across the ring: the sender fills slot k+1 while the receiver drains slot k.
//
// The caller's stream: at post time the engine records a "ready" event on the
// caller's stream (the producer of the send buffer / last user of the receive
// buffer) and the comm stream waits on it before the first copy; when the
// last copy is enqueued the engine records the op's done event, which the
// caller's compute stream can wait on (Op::wait_stream) without host sync.
// The engine holds two comm streams (sends, receives), so a receive waiting
// for its peer never delays this rank's sends on the device.
//
// Matching: messages on a channel arrive in the sender's posting order; the
// first chunk of a message is given to the earliest posted receive with the
// same tag. A size or dtype mismatch fails that receive with a message naming
// both sides and the message is drained without being copied anywhere.
//
// Zero-copy sends (ipc staging, messages of at least direct_min_bytes whose
// buffer can be exported): instead of data, the chunk descriptor carries an
// IPC handle of the sender's allocation plus the offset; the receiver opens it
// (cached per allocation), copies straight from the sender's buffer into its
// own on its comm stream (one copy instead of two), records free_event[slot]
// and bumps `freed`. The sender's op completes when its comm stream has waited
// on that free event: only then may the caller reuse the buffer. The
// receiver keeps up to 32 sender allocations mapped (LRU; ipc_engine.cu).
//
// Threading: one engine-owned worker thread drives every channel (so posting
// returns at once and both sides can post sends before receives without
// deadlock); the posting thread only records the ready event and queues.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dualpipe::cuda {

// Throws std::runtime_error naming the CUDA call, the error and the source line.
void check_cuda(cudaError_t err, const char* expr, const char* file, int line);
#define DPK_CUDA_CHECK(expr) ::dualpipe::cuda::check_cuda((expr), #expr, __FILE__, __LINE__)

inline constexpr int kMaxSlots = 16;
inline constexpr int kDtypeNameLen = 24;

enum class Staging : int32_t { kAuto = -1, kIpc = 0, kHost = 1 };
enum class OpKind : int32_t { kSend = 0, kRecv = 1 };

struct EngineOptions {
  int32_t num_slots = 4;           // ring depth per channel, 2..kMaxSlots
  uint64_t slot_bytes = 4u << 20;  // bytes per slot (chunk size), > 0
  Staging staging = Staging::kAuto;
  uint64_t direct_min_bytes = 1u << 20;  // zero-copy sends from this size on (ipc staging); 0: never
};

// One posted send or receive. Shared by the engine (until its copies are
// enqueued) and the Python handle.
class Op {
 public:
  Op(OpKind kind, int rank, int peer, int64_t tag, char* ptr, uint64_t bytes, const std::string& dtype);
  ~Op();
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;

  // Blocks up to timeout_s seconds (negative: no limit). True when the
  // transfer is complete on the device; false on timeout; throws
  // std::runtime_error when the transfer failed.
  bool wait(double timeout_s);
  // Non-blocking: true when complete or failed (wait() then raises).
  bool query();
  // Makes `stream` wait for the transfer on the device. Blocks the host only
  // until the engine has enqueued the transfer's copies (which needs the
  // peer's matching post); false on timeout; throws when the transfer failed.
  bool wait_stream(cudaStream_t stream, double timeout_s);
  bool failed() const;
  std::string error() const;
  std::string describe() const;

 private:
  friend class Engine;
  enum class State { kPosted, kEnqueued, kFailed };
  bool wait_enqueued(double timeout_s);  // false on timeout; throws on failure
  void mark_enqueued();
  void fail(const std::string& why);

  const OpKind kind_;
  const int rank_;
  const int peer_;
  const int64_t tag_;
  char* const ptr_;
  const uint64_t bytes_;
  char dtype_[kDtypeNameLen] = {};
  cudaEvent_t ready_event_ = nullptr;  // recorded on the caller's stream at post time
  cudaEvent_t done_event_ = nullptr;   // recorded on the comm stream after the last copy
  char* alloc_base_ = nullptr;         // start of the caller's allocation (zero-copy export), or null
  bool direct_ = false;                // this send goes zero-copy (decided at its first chunk)
  cudaIpcMemHandle_t handle_{};        // IPC handle of alloc_base_ when direct_
  uint64_t offset_ = 0;                // bytes enqueued so far (engine thread only)
  bool started_ = false;               // comm stream already waits on ready_event_
  // Keeps the caller's buffer alive until its copies are enqueued (the
  // binding puts a tensor here; the caching allocator's record_stream covers
  // the rest). Released by the engine outside its lock.
  std::shared_ptr<void> keepalive_;
  std::atomic<uint64_t> chunks_enqueued_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kPosted;
  std::string error_;
};

struct CtlBlock;  // shared-memory control block (ipc_engine.cu)

// A peer allocation mapped for zero-copy receives. CUDA lets a process map an
// allocation only once, so mappings are cached by handle bytes, and by the
// sender's base address for the case where the same allocation arrives under
// different handle bytes (cudaErrorAlreadyMapped).
struct PeerMapping {
  std::string key;        // the cudaIpcMemHandle_t bytes
  uint64_t src_base = 0;  // sender's address of the allocation (0: superseded, never aliased)
  char* ptr = nullptr;    // where it is mapped here
  uint64_t last_use = 0;
};

struct Channel {
  int peer = -1;
  bool outgoing = false;
  Staging staging = Staging::kIpc;
  int num_slots = 0;
  uint64_t slot_bytes = 0;
  std::string shm_name;
  void* shm_base = nullptr;
  size_t shm_size = 0;
  bool shm_linked = false;  // receiver: segment name still in /dev/shm
  CtlBlock* ctl = nullptr;
  char* slots = nullptr;  // device ring (own or IPC-mapped) or host ring inside the segment
  bool slots_device_owned = false;
  bool slots_ipc_opened = false;
  bool host_registered = false;
  cudaEvent_t local_events[kMaxSlots] = {};  // outgoing: ready events; incoming: free events
  cudaEvent_t peer_events[kMaxSlots] = {};   // opened from the peer (ipc staging only)
  uint64_t next_chunk = 0;
  uint64_t next_msg_seq = 0;
  std::deque<std::shared_ptr<Op>> queue;  // outgoing: sends in wire order; incoming: posted receives
  std::deque<uint64_t> pending;           // host staging: chunks whose local copy is still running
  // outgoing: zero-copy sends published as chunk `first`, waiting for the receiver's copy
  std::deque<std::pair<uint64_t, std::shared_ptr<Op>>> awaiting;
  // incoming: the peer's allocations mapped for zero-copy receives (at most kMaxOpened, LRU)
  std::vector<PeerMapping> opened;
  uint64_t map_clock = 0;
  std::shared_ptr<Op> current;            // incoming: receive being filled
  uint64_t msg_offset = 0;                // incoming: next expected byte offset in the current message
  bool discarding = false;                // incoming: draining a mismatched message
  bool ready = false;                     // rendezvous finished, usable
};

class Engine {
 public:
  Engine(int rank, int device, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const { return rank_; }
  int device() const { return device_; }
  // Comm streams (non-blocking, high priority): sends and receives each get
  // one, so a receive waiting for its peer never holds up this rank's sends.
  cudaStream_t stream_for(OpKind kind) const { return kind == OpKind::kSend ? send_stream_ : recv_stream_; }

  // Rendezvous, in this order on every rank (names travel through a store):
  //   name = create_incoming(src)       receiver: allocate ring + control block
  //   attach_outgoing(dst, name_of_dst) sender:   map the peer's channel
  //   finish_incoming(src)              receiver: after the sender attached
  std::string create_incoming(int src);
  void attach_outgoing(int dst, const std::string& shm_name);
  void finish_incoming(int src);
  // "ipc" or "host": the staging the receiver chose for the channel.
  std::string channel_staging(int peer, bool outgoing) const;
  // One line for error messages: counters, queue lengths, peer process state.
  std::string channel_status(int peer, bool outgoing) const;

  // Posts a transfer of `bytes` bytes at `ptr` (device memory of this engine's
  // device, owned by the caller until the op completes). The comm stream
  // first waits for the work already queued on `caller_stream`.
  // `keepalive` (may be null) is held until the op's copies are enqueued.
  // `alloc_base` (may be null) is the start of the allocation holding `ptr`,
  // which lets a large send go zero-copy.
  std::shared_ptr<Op> post(OpKind kind, int peer, int64_t tag, void* ptr, uint64_t bytes, const std::string& dtype,
                           cudaStream_t caller_stream, std::shared_ptr<void> keepalive, void* alloc_base = nullptr);
  uint64_t direct_min_bytes() const { return options_.direct_min_bytes; }

  // Stops the worker, fails unfinished ops, waits up to timeout_s for the
  // comm stream and for peers to detach, then frees everything. Idempotent.
  void close(double timeout_s);

 private:
  void worker_main();
  bool progress_send(Channel& ch);
  bool progress_recv(Channel& ch);
  bool retire_pending(Channel& ch);
  char* open_peer_buffer(Channel& ch, const cudaIpcMemHandle_t& handle, uint64_t src_base);
  bool has_pending_work_locked() const;
  void fail_all_locked(const std::string& why);
  void finish_op_locked(Op& op, const std::string& failure);  // empty failure: enqueued
  void release_imports(Channel& ch, bool streams_idle);
  void release_exports(Channel& ch, std::chrono::steady_clock::time_point deadline, bool streams_idle);
  Channel& channel_locked(int peer, bool outgoing);
  const Channel& channel_locked(int peer, bool outgoing) const;

  const int rank_;
  const int device_;
  const EngineOptions options_;
  cudaStream_t send_stream_ = nullptr;
  cudaStream_t recv_stream_ = nullptr;
  std::map<int, Channel> outgoing_;
  std::map<int, Channel> incoming_;

  mutable std::mutex mu_;  // guards channels, queues and the fields below
  std::condition_variable cv_;
  bool stop_ = false;
  bool closed_ = false;
  std::string engine_error_;  // set when the worker hit a CUDA or protocol error
  std::vector<std::shared_ptr<void>> released_;  // keepalives to drop once mu_ is released
  std::thread worker_;
};

}  // namespace dualpipe::cuda
