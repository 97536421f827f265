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
// segment (host counters, a ring of `max_inflight` chunk descriptors, IPC
// handles) plus a byte ring of num_slots * slot_bytes. The ring is device
// memory exported with cudaIpcGetMemHandle ("ipc" staging), followed in the
// same allocation by a signal block of two 64-bit device counters, or, where
// IPC is not possible, pinned host memory inside the same shared segment
// ("host" staging: D2H into the ring, H2D out of it).
//
// Protocol, ipc staging. Chunk numbers start at counter_base and wrap around
// 2^64; every comparison is wrap-safe (reached()). Device counters, written
// and awaited by the streams themselves (DeviceApi::stream_write_value /
// stream_wait_value: the driver's stream memory operations):
//   ready  written by the sender's send stream:  chunk n's data (staged: in
//          the ring; zero-copy: in the sender's buffer) is ready once ready >= n+1.
//   freed  written by the receiver's receive stream: chunk n has been copied
//          out (its ring bytes and, zero-copy, the sender's buffer are free)
//          once freed >= n+1.
// Host counters in the control block (the hosts only enqueue; they never wait
// for device work):
//   published  (sender)   descriptors up to n written, their device work enqueued.
//   taken      (receiver) chunks up to n consumed, their drains enqueued.
// Sender, chunk n: publish only while n < taken + max_inflight (the
//   descriptor ring). Staged: place the chunk at the next 256-byte position of
//   the byte ring; if that overwrites chunk m's bytes, wait (host) until
//   taken > m, then the send stream waits freed >= m+1 (device), copies in,
//   and writes ready = n+1. Zero-copy: the send stream writes ready = n+1
//   once the producer is done; when taken > n, the engine's *done* stream
//   waits freed >= n+1 and records the op's done event there (so later sends
//   never queue behind a done-wait).
// Receiver, chunk n: once published > n, match the message's first chunk with
//   the earliest posted receive of its tag; the receive stream waits ready >= n+1,
//   copies out (from the ring, or from the sender's mapped buffer), writes
//   freed = n+1; taken = n+1.
// Every device wait is enqueued only after the host counters show that the
// write it waits for is already enqueued by the peer, so a stream never waits
// on a peer's host: no device-side deadlock whatever the posting order. If the
// peer dies with a write enqueued but not executed, the worker (which checks
// the peer's pid while work is outstanding) sets the counter our streams wait
// on to its highest awaited value from the host (DeviceApi::set_value), which
// releases them, and fails the channel's ops naming the dead peer.
// Small messages take 256 bytes of the ring each, so a burst of them costs
// no round trip between the two processes' contexts until the ring wraps;
// large ones are split into slot_bytes chunks pipelined through the ring.
// Events: the caller-stream dependency ("ready" event, recorded at post) and
// the op's done event come from a pool made at construction (no event is
// created per message; none crosses processes).
//
// Protocol, host staging (IPC not possible): the same descriptors and host
// counters, but published/taken advance only once the local D2H/H2D copy has
// finished (a pool event per chunk, polled by the worker).
//
// The caller's stream: at post time the engine records the op's ready event
// on the caller's stream (the producer of the send buffer / last user of the
// receive buffer) and the comm stream waits on it before the first copy; the
// op's done event (after the last copy, or the done-wait) is what the
// caller's compute stream waits on (Op::wait_stream) without host sync.
// The engine holds three comm streams (sends, receives, done-waits), so a
// receive waiting for its peer never delays this rank's sends on the device.
//
// Matching: messages on a channel arrive in the sender's posting order; the
// first chunk of a message is given to the earliest posted receive with the
// same tag. A size or dtype mismatch fails that receive with a message naming
// both sides and the message is consumed without being copied anywhere.
//
// Zero-copy sends (ipc staging, messages of at least direct_min_bytes whose
// buffer can be exported): instead of data, the chunk descriptor carries an
// IPC handle of the sender's allocation plus the offset; the receiver opens it
// (cached), copies straight from the sender's buffer into its own on its comm
// stream (one copy instead of two) and writes freed. The sender's op
// completes when its done stream has waited for that freed value: only then
// may the caller reuse the buffer. The buffer may lie
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
// receiver closes that mapping once a pool event recorded after its copies
// has fired (no host wait) and publishes unmapped_gen; only
// then does the sender drop the keep-alive and reuse the entry. At close the
// receiver unmaps everything before it says kDetached; the sender drops its
// keep-alives once the receiver detached or died, and otherwise keeps them
// for the engine's lifetime.
//
// Threading: one engine-owned worker thread drives every channel (so posting
// returns at once and both sides can post sends before receives without
// deadlock); the posting thread only records the ready event and queues. The
// engine lock guards the hand-over (inboxes, channel maps, errors) and is
// never held across a device call: the worker's channel state is its own.
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
#include <functional>
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
  std::int32_t num_slots = 4;                // the ring holds num_slots * slot_bytes, num_slots in 2..kMaxSlots
  std::uint64_t slot_bytes = 4u << 20;       // the largest staged chunk, a positive multiple of 256
  Staging staging = Staging::kAuto;          // auto: ipc if this host can export memory, else host
  std::uint64_t direct_min_bytes = 1u << 20;  // zero-copy sends from this size on (ipc staging); 0: never
  // receiver: sender allocations kept mapped per channel, 1..kMaxExports; the
  // sender keeps as many alive (the latest storage sent from each)
  std::uint32_t max_peer_mappings = 32;
  // receiver: chunks a sender may publish ahead of this receiver's host, 1..kMaxInflight
  // (large enough by default that the copy engine, not the signal round trip, bounds a burst)
  std::int32_t max_inflight = 256;
  // The first chunk number of every channel (tests start it near 2^64 to wrap around).
  std::uint64_t counter_base = 0;
  // Streams to run the copies and done-waits on, owned by the caller and alive
  // for the whole process (the bindings pass three of torch's pooled streams);
  // null: the engine creates its own and destroys them at close. Borrowed
  // streams matter under a caching allocator: a buffer recorded on a comm
  // stream (recordStream) records an event on that stream when it is freed,
  // which fails, and aborts the process, if the stream was destroyed in between.
  Stream send_stream = nullptr;
  Stream recv_stream = nullptr;
  Stream done_stream = nullptr;
  // Why a peer's process is dead ("" while alive); tests replace it to kill a peer.
  std::function<std::string(int pid)> peer_dead_reason;
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
  std::uint64_t exports_leaked = 0;  //!< rings not freed at close because a live peer still mapped them
  std::uint64_t events_created = 0;  //!< events made by the pool (at construction, and if ever it ran dry)
  std::uint64_t stream_waits = 0;    //!< device counter waits enqueued
  std::uint64_t peers_died = 0;      //!< channels failed because the peer's process died
};

//! Events made once and handed out again: no event is created per message.
class EventPool {
 public:
  EventPool(std::shared_ptr<DeviceApi> api, std::size_t initial);
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  //! An event (a new one only when all are handed out; the caller's device must be current).
  Event take();
  void give(Event e);
  std::uint64_t created() const;
  DeviceApi& api() { return *api_; }

 private:
  const std::shared_ptr<DeviceApi> api_;
  mutable std::mutex mu_;
  std::vector<Event> free_;
  std::uint64_t created_ = 0;
};

// One posted send or receive. Shared by the engine (until its copies are
// enqueued) and the Python handle. Its Request completes when the copies are
// enqueued; the done event then tells when they ran.
class Op {
 public:
  Op(std::shared_ptr<EventPool> pool, TransferInfo info, char* ptr);
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
  bool failed() const { return request_.state() == Request::State::kFailed || poisoned_.load(); }
  std::string error() const;
  std::string describe() const;
  //! Whether this send went zero-copy (decided when its first chunk is enqueued).
  bool zero_copy() const { return zero_copy_.load(std::memory_order_acquire); }

 private:
  friend class Engine;
  bool wait_enqueued(double timeout_s);  // false on timeout; throws on failure
  // Fails an op whose copies were already enqueued (its peer died before the
  // data they read was ready): wait/query/wait_stream then throw `why`.
  void poison(const std::string& why);
  void throw_if_poisoned() const;

  const std::shared_ptr<EventPool> pool_;
  DeviceApi& api_;
  Request request_;
  OpKind kind() const { return request_.info().direction == Direction::kSend ? OpKind::kSend : OpKind::kRecv; }
  std::int64_t tag() const { return request_.info().tag; }
  std::uint64_t bytes() const { return request_.info().nbytes; }
  char* const ptr_;
  char dtype_[kDtypeNameLen] = {};
  Event ready_event_ = nullptr;  // recorded on the caller's stream at post time (from the pool)
  Event done_event_ = nullptr;   // recorded after the last copy or the done-wait (from the pool)
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
  mutable std::mutex poison_mu_;
  std::string poison_;
  std::atomic<bool> poisoned_{false};
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
  //! The stream of zero-copy sends' done-waits.
  Stream done_stream() const { return done_stream_; }
  DeviceApi& device_api() { return *api_; }

  // Rendezvous, in this order on every rank (names travel through a store):
  //   name = create_incoming(src)       receiver: allocate ring + control block
  //   attach_outgoing(dst, name_of_dst) sender:   map the peer's channel, unlink its name
  //   finish_incoming(src)              receiver: after the sender attached
  // attach_outgoing throws IpcUnavailable when this process cannot map the
  // peer's ring (CUDA IPC not possible here): use staging "host".
  std::string create_incoming(int src);
  void attach_outgoing(int dst, const std::string& shm_name);
  void finish_incoming(int src);
  // "ipc" or "host": the staging the receiver chose for the channel.
  std::string channel_staging(int peer, bool outgoing) const;
  // One line for error messages: counters, queue lengths, peer process state.
  std::string channel_status(int peer, bool outgoing) const;
  EngineStats stats() const;
  //! The channel's host counters as stored (published, taken): chunk numbers from counter_base, wrapping.
  std::pair<std::uint64_t, std::uint64_t> host_counters(int peer, bool outgoing) const;

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

  // Fails every unfinished op with `why` (those whose copies are enqueued but not
  // done too: their waits throw it) and every later post; the first call's text
  // sticks. The streams and mappings stay until close(); the peer is not told.
  void fail_all(const std::string& why);

  // Stops the worker, fails unfinished ops, waits up to timeout_s for the
  // comm streams and for peers to detach, then frees what is safe to free
  // (see the teardown note above). Idempotent.
  void close(double timeout_s);

 private:
  void make_device_ring(Channel& ch, IpcMemHandle* ring_handle);
  void map_peer_ring(Channel& ch, int dst);
  void worker_main();
  bool worker_round();  // one pass over every channel, without the lock; true if anything moved
  bool progress_send(Channel& ch);
  bool progress_recv(Channel& ch);
  bool start_send(Channel& ch, Op& op);
  void publish_direct(Channel& ch, std::uint64_t n);
  bool place_staged(Channel& ch, std::uint64_t bytes, std::uint64_t* offset);
  bool take_receive(Channel& ch, const ChunkDesc& d);
  void copy_direct(Channel& ch, const ChunkDesc& d);
  bool retire_pending(Channel& ch);
  void wait_peer_signal(Channel& ch, Stream s, std::uint64_t* signal, std::uint64_t value);
  bool check_peer_alive(Channel& ch);
  ChunkDesc& desc_of(Channel& ch, std::uint64_t n) const {
    return ch.ctl->desc[(n - ch.base) % ch.inflight];
  }
  // Exports (ipc_exports.cpp). Sender:
  int export_for_send(Channel& ch, Op& op);  // the op's export entry, or -1: send it staged
  void request_retire(Channel& ch);
  void collect_unmapped(Channel& ch);
  void release_keepalives(Channel& ch, bool peer_unmapped);
  // Receiver:
  bool serve_retire_requests(Channel& ch);
  bool retire_closing(Channel& ch);
  char* open_peer_buffer(Channel& ch, const ChunkDesc& d);
  void close_mappings(Channel& ch);
  bool has_pending_work(const Channel& ch) const;
  void fail_channel(Channel& ch, const std::string& why);
  void finish_op(Op& op, const std::string& failure);  // empty failure: enqueued
  void release_imports(Channel& ch, bool streams_idle);
  void release_exports(Channel& ch, std::chrono::steady_clock::time_point deadline, bool streams_idle);
  bool drain_streams(std::chrono::steady_clock::time_point deadline);
  Channel& channel_locked(int peer, bool outgoing);
  const Channel& channel_locked(int peer, bool outgoing) const;
  template <class F>
  void bump(F field) {
    std::lock_guard<std::mutex> lk(stats_mu_);
    ++(stats_.*field);
  }
  std::string peer_dead_reason(int pid) const;

  const std::shared_ptr<DeviceApi> api_;
  const int rank_;
  const int device_;
  const EngineOptions options_;
  std::shared_ptr<EventPool> pool_;
  Stream send_stream_ = nullptr;
  Stream recv_stream_ = nullptr;
  Stream done_stream_ = nullptr;
  bool owns_streams_ = true;  // false: EngineOptions::*_stream, not destroyed here

  mutable std::mutex mu_;  // the engine lock: channel maps, inboxes, and the fields below; never held across a device call
  std::condition_variable cv_;
  std::map<int, std::unique_ptr<Channel>> outgoing_;
  std::map<int, std::unique_ptr<Channel>> incoming_;
  bool channels_changed_ = false;
  std::uint64_t posted_ = 0;  // posts so far (wakes the worker)
  bool stop_ = false;
  bool closed_ = false;
  std::string engine_error_;  // set when the worker hit a CUDA or protocol error
  std::mutex rendezvous_mu_;  // serialises the rendezvous calls (device calls, without the engine lock)

  mutable std::mutex stats_mu_;
  EngineStats stats_;

  // The worker's own (no lock): the ready channels, keep-alives to drop after a round.
  std::vector<Channel*> active_;
  std::vector<std::shared_ptr<void>> released_;
  // Segments whose host ring copies may still be in flight at close (streams
  // did not drain): kept mapped for the engine's lifetime, not pulled away.
  std::vector<ShmSegment> abandoned_;
  // Export keep-alives of peers that may still map them at close: held for
  // the engine's lifetime rather than freed under a live mapping.
  std::vector<std::shared_ptr<void>> abandoned_keepalives_;
  std::thread worker_;
};

}  // namespace dualpipe::cuda
