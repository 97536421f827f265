// CUDA IPC comm engine: point-to-point transfers between processes on one host.
//
// No torch, no pybind11 and no CUDA header here: the engine sees raw device
// pointers, byte counts and opaque streams, and makes every CUDA runtime call
// through DeviceApi (device_api.h), so its host logic is unit-tested over a
// fake device (csrc/tests/test_ipc_engine.cpp). csrc/cuda/cuda_bindings.cpp
// adapts tensors; csrc/cuda/cuda_runtime.cu is the real device layer.
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
// (cached), copies straight from the sender's buffer into its own on its comm
// stream (one copy instead of two), records free_event[slot] and bumps
// `freed`. The sender's op completes when its comm stream has waited on that
// free event: only then may the caller reuse the buffer. The buffer may lie
// anywhere inside its allocation (views go zero-copy too).
//
// Keep-alive (exports, ipc_exports.cpp). The receiver keeps sender
// allocations mapped across messages (cudaIpcOpenMemHandle is expensive), so
// the sender must not let one be freed while it is mapped: torch's caching
// allocator cudaFrees a segment once its blocks are released (empty_cache,
// its OOM retry). The sender owns a table of export entries, as many as the
// receiver's max_peer_mappings (CtlBlock::export_slots): a live entry holds
// the allocation's handle (cudaIpcGetMemHandle once per allocation) and a
// keep-alive of the latest storage sent from it, which keeps the allocation
// and so the handle valid. Each reuse of an entry starts a new generation;
// a direct chunk names (entry, generation). The receiver maps by entry.
// Eviction is decided by the sender, which knows its allocations: when a new
// allocation finds every entry live, it asks the receiver to unmap its least
// recently used entry whose chunks the receiver has all consumed (retire_gen,
// retire_posted) and sends this message through the ring meanwhile. The
// receiver closes that mapping once an event recorded after its copies has
// fired (no host wait under the engine lock) and publishes unmapped_gen; only
// then does the sender drop the keep-alive and reuse the entry. At close the
// receiver unmaps everything before it says kDetached; the sender drops its
// keep-alives once the receiver detached or died, and otherwise keeps them
// for the engine's lifetime.
//
// Threading: one engine-owned worker thread drives every channel (so posting
// returns at once and both sides can post sends before receives without
// deadlock); the posting thread only records the ready event and queues.
//
// Segments and teardown: the control block lives in a segment named like
// every other of ours ("/dpk-<pid>-...", common/segment.h); the sender unlinks
// its name as soon as it has mapped it (both sides then hold a mapping), so a
// process killed at any later moment leaves nothing in /dev/shm, and one
// killed earlier leaves a name that any engine's start or close sweeps.
// At close each side first closes what it mapped of the peer and publishes
// kDetached (or kAbandoned when its copies did not drain in time), then frees
// what it exported once the peer detached, died or never attached. Exports a
// live, attached peer still maps are leaked, never freed under it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/request.h"
#include "cuda/device_api.h"
#include "cuda/ipc_channel.h"

namespace dualpipe::cuda {

enum class OpKind : std::int32_t { kSend = 0, kRecv = 1 };

struct EngineOptions {
  std::int32_t num_slots = 4;                // ring depth per channel, 2..kMaxSlots
  std::uint64_t slot_bytes = 4u << 20;       // bytes per slot (chunk size), a positive multiple of 256
  Staging staging = Staging::kAuto;          // auto: ipc if this host can export memory and events, else host
  std::uint64_t direct_min_bytes = 1u << 20;  // zero-copy sends from this size on (ipc staging); 0: never
  // receiver: sender allocations kept mapped per channel, 1..kMaxExports; the
  // sender keeps as many alive (the latest storage sent from each)
  std::uint32_t max_peer_mappings = 32;
  // Streams to run the copies on, owned by the caller and alive for the whole
  // process (the bindings pass two of torch's pooled streams); null: the
  // engine creates its own and destroys them at close. Borrowed streams matter
  // under a caching allocator: a buffer recorded on a comm stream
  // (recordStream) records an event on that stream when it is freed, which
  // fails, and aborts the process, if the stream was destroyed in between.
  Stream send_stream = nullptr;
  Stream recv_stream = nullptr;
};

//! What the engine did, for tests and benchmarks (monotonic since construction).
struct EngineStats {
  std::uint64_t zero_copy_sends = 0;   //!< sends that went straight from the caller's buffer
  std::uint64_t staged_sends = 0;      //!< sends copied through the ring
  std::uint64_t zero_copy_recvs = 0;   //!< receives copied straight from the sender's buffer
  std::uint64_t staged_recvs = 0;      //!< receives copied out of the ring
  std::uint64_t mem_handle_exports = 0;  //!< cudaIpcGetMemHandle calls: one per exported allocation
  std::uint64_t zero_copy_deferred = 0;  //!< large sends staged because every export entry was in use
  std::uint64_t exports_released = 0;    //!< export keep-alives dropped after the receiver unmapped them
  std::uint64_t peer_mappings_opened = 0;
  std::uint64_t peer_mappings_closed = 0;
  std::uint64_t exports_leaked = 0;  //!< rings/events not freed at close because a live peer still mapped them
};

// One posted send or receive. Shared by the engine (until its copies are
// enqueued) and the Python handle. Its Request completes when the copies are
// enqueued; the done event then tells when they ran.
class Op {
 public:
  Op(DeviceApi& api, TransferInfo info, char* ptr);
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
  bool wait_stream(Stream stream, double timeout_s);
  bool failed() const { return request_.state() == Request::State::kFailed; }
  std::string error() const { return request_.error(); }
  std::string describe() const;
  //! Whether this send went zero-copy (decided when its first chunk is enqueued).
  bool zero_copy() const { return zero_copy_.load(std::memory_order_acquire); }

 private:
  friend class Engine;
  bool wait_enqueued(double timeout_s);  // false on timeout; throws on failure

  DeviceApi& api_;
  Request request_;
  OpKind kind() const { return request_.info().direction == Direction::kSend ? OpKind::kSend : OpKind::kRecv; }
  std::int64_t tag() const { return request_.info().tag; }
  std::uint64_t bytes() const { return request_.info().nbytes; }
  char* const ptr_;
  char dtype_[kDtypeNameLen] = {};
  Event ready_event_ = nullptr;  // recorded on the caller's stream at post time
  Event done_event_ = nullptr;   // recorded on the comm stream after the last copy
  char* alloc_base_ = nullptr;   // start of the caller's allocation (zero-copy export), or null
  std::uint64_t alloc_bytes_ = 0;  // its size, when known
  bool direct_ = false;          // this send goes zero-copy (engine thread only)
  std::atomic<bool> zero_copy_{false};
  int export_slot_ = -1;    // the channel's export entry of alloc_base_ when direct_
  std::uint64_t offset_ = 0;  // bytes enqueued so far (engine thread only)
  bool started_ = false;      // comm stream already waits on ready_event_
  // Keeps the caller's buffer alive until its copies are enqueued (the
  // binding puts a tensor here; the caching allocator's record_stream covers
  // the rest). Released by the engine outside its lock.
  std::shared_ptr<void> keepalive_;
  std::atomic<std::uint64_t> chunks_enqueued_{0};
};

class Engine {
 public:
  Engine(std::shared_ptr<DeviceApi> api, int rank, int device, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const { return rank_; }
  int device() const { return device_; }
  // Comm streams (non-blocking, high priority): sends and receives each get
  // one, so a receive waiting for its peer never holds up this rank's sends.
  Stream stream_for(OpKind kind) const { return kind == OpKind::kSend ? send_stream_ : recv_stream_; }

  // Rendezvous, in this order on every rank (names travel through a store):
  //   name = create_incoming(src)       receiver: allocate ring + control block
  //   attach_outgoing(dst, name_of_dst) sender:   map the peer's channel, unlink its name
  //   finish_incoming(src)              receiver: after the sender attached
  // attach_outgoing throws IpcUnavailable when this process cannot map the
  // peer's ring or events (CUDA IPC not possible here): use staging "host".
  std::string create_incoming(int src);
  void attach_outgoing(int dst, const std::string& shm_name);
  void finish_incoming(int src);
  // "ipc" or "host": the staging the receiver chose for the channel.
  std::string channel_staging(int peer, bool outgoing) const;
  // One line for error messages: counters, queue lengths, peer process state.
  std::string channel_status(int peer, bool outgoing) const;
  EngineStats stats() const;

  // Posts a transfer of `bytes` bytes at `ptr` (device memory of this engine's
  // device, owned by the caller until the op completes). The comm stream
  // first waits for the work already queued on `caller_stream`.
  // `keepalive` (may be null) is held until the op's copies are enqueued.
  // `alloc_base` (may be null) is the start of the allocation holding `ptr`
  // (ptr may lie anywhere inside it) and `alloc_bytes` its size (0: unknown),
  // which lets a large send go zero-copy; `keepalive` must then keep that
  // allocation from being freed (the engine holds it while the receiver maps it).
  std::shared_ptr<Op> post(OpKind kind, int peer, std::int64_t tag, void* ptr, std::uint64_t bytes,
                           const std::string& dtype, Stream caller_stream, std::shared_ptr<void> keepalive,
                           void* alloc_base = nullptr, std::uint64_t alloc_bytes = 0);
  std::uint64_t direct_min_bytes() const { return options_.direct_min_bytes; }

  // Stops the worker, fails unfinished ops, waits up to timeout_s for the
  // comm streams and for peers to detach, then frees what is safe to free
  // (see the teardown note above). Idempotent.
  void close(double timeout_s);

 private:
  void make_device_ring(Channel& ch, IpcMemHandle* ring_handle, IpcEventHandle* event_handles);
  void map_peer_ring(Channel& ch, int dst);
  void worker_main();
  bool progress_send(Channel& ch);
  bool progress_recv(Channel& ch);
  bool start_send_locked(Channel& ch, Op& op);
  void publish_direct_locked(Channel& ch, std::uint64_t n);
  bool take_receive_locked(Channel& ch, const ChunkDesc& d);
  void copy_direct_locked(Channel& ch, const ChunkDesc& d);
  bool retire_pending(Channel& ch);
  // Exports (ipc_exports.cpp). Sender:
  int export_for_send_locked(Channel& ch, Op& op);  // the op's export entry, or -1: send it staged
  void request_retire_locked(Channel& ch);
  void collect_unmapped_locked(Channel& ch);
  void release_keepalives_locked(Channel& ch, bool peer_unmapped);
  // Receiver:
  bool serve_retire_requests(Channel& ch);
  bool retire_closing(Channel& ch);
  char* open_peer_buffer(Channel& ch, const ChunkDesc& d);
  void close_mappings(Channel& ch);
  bool has_pending_work_locked() const;
  void fail_all_locked(const std::string& why);
  void finish_op_locked(Op& op, const std::string& failure);  // empty failure: enqueued
  void release_imports(Channel& ch, bool streams_idle);
  void release_exports(Channel& ch, std::chrono::steady_clock::time_point deadline, bool streams_idle);
  bool drain_streams(std::chrono::steady_clock::time_point deadline);
  Channel& channel_locked(int peer, bool outgoing);
  const Channel& channel_locked(int peer, bool outgoing) const;

  const std::shared_ptr<DeviceApi> api_;
  const int rank_;
  const int device_;
  const EngineOptions options_;
  Stream send_stream_ = nullptr;
  Stream recv_stream_ = nullptr;
  bool owns_streams_ = true;  // false: EngineOptions::{send,recv}_stream, not destroyed here
  std::map<int, Channel> outgoing_;
  std::map<int, Channel> incoming_;

  mutable std::mutex mu_;  // guards channels, queues and the fields below
  std::condition_variable cv_;
  bool stop_ = false;
  bool closed_ = false;
  std::string engine_error_;  // set when the worker hit a CUDA or protocol error
  EngineStats stats_;
  std::vector<std::shared_ptr<void>> released_;  // keepalives to drop once mu_ is released
  // Segments whose host ring copies may still be in flight at close (streams
  // did not drain): kept mapped for the engine's lifetime, not pulled away.
  std::vector<ShmSegment> abandoned_;
  // Export keep-alives of peers that may still map them at close: held for
  // the engine's lifetime rather than freed under a live mapping.
  std::vector<std::shared_ptr<void>> abandoned_keepalives_;
  std::thread worker_;
};

}  // namespace dualpipe::cuda
