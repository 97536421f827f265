// One end of a directed shared-memory channel: a SendChannel in the sending
// process, a RecvChannel in the receiving one, both over the same RingView.
//
// Threads. Each channel owns one worker thread (started on the first post) that
// does the copies, so post() returns at once with a Request. A small send that
// fits in a free slot while nothing else is queued is copied by the posting
// thread itself (saves a thread hand-off on the latency path); likewise a small
// receive whose whole message already sits in the ring while no other receive
// is pending. A thread waiting on a small receive polls the ring while it
// spins and copies a whole one-chunk message itself when it lands; after its
// spin it sleeps on the ring's head futex (the sender's publish wakes it) and
// copies it then. With recv_poll_ms > 0 (the default) the receive worker leaves
// small receives to their waiters: it is not woken by posts or publishes for
// them, looks every recv_poll_ms for messages nobody waits on, and watches the
// ring (woken by each publish) only while a large receive is posted or a waiter
// has handed its receive over (a chunk it cannot copy itself, or a whole
// liveness interval asleep). With recv_poll_ms == 0 it watches the ring for
// every posted receive. The worker waits for the sender without holding the
// token so that a waiter can copy. Whoever copies holds the channel's "busy"
// token (busy_ under mu_).
//
// Ordering and matching. Sends are written into the ring in post order. A
// message is delivered to the earliest posted, still unmatched receive with
// the same tag (per-tag FIFO, as in torch.distributed); a message whose tag no
// posted receive wants while another receive is waiting behind it is copied
// once into a heap "stash" so the ring keeps moving. A matched receive whose
// byte count or dtype code differs from the message fails with a message
// naming both sides, marks the ring broken (the sender's next operation fails
// too) and never writes the caller's buffer.
//
// Single copy (see shm_ring.h). A send of >= single_copy_min_bytes, when the
// receiver's attach-time probe allowed it, posts a descriptor instead of its
// payload and completes only once the receiver has read the bytes straight
// from the sender's buffer (process_vm_readv) and released the slot. Matching,
// mismatch errors and liveness are the same as on the ring path; a sender that
// dies mid-read is reported by pid, as is a receiver that dies before it acks.
//
// Reserved slots (zero staging). SendChannel::reserve() hands one caller the
// next ring slot as writable memory: the caller writes the message there itself
// (e.g. packs tensors straight into it) and SlotReservation::commit() publishes
// it as one chunk, so no staging copy is made. The reservation holds the busy
// token: sends posted meanwhile queue behind it, and it is granted only when no
// send is queued or running (post order is the ring order). abort() (or the
// destructor) gives the slot back unpublished.
//
// Liveness. While sleeping on the ring a worker re-checks every
// `liveness_interval_s` whether the peer process still exists (pid in the ring
// header), whether the peer closed its end and whether the ring is broken.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/request.h"
#include "shm_ring.h"
#include "common/segment.h"

namespace dualpipe::shm {

//! The most a worker thread spins for a new post (it shares the rank's core with the posting thread).
inline constexpr double kWorkerSpinUs = 50.0;

//! Single-copy messages of at least this size are read by two threads (halves).
inline constexpr std::uint64_t kParallelReadMinBytes = 8u << 20;

struct ChannelConfig {
  std::uint32_t num_slots = 8;                 //!< ring slots (>= 2)
  std::uint64_t slot_bytes = 256 * 1024;       //!< payload bytes per slot (>= 64)
  //! A waiting thread spins this long before it sleeps (futex / condvar).  Long enough to cover the
  //! wait between two actions of a peer: a waiter that sleeps costs the sender a futex wake per
  //! message (about 6 us on a VM) and itself a wake-up; its core is otherwise idle while it waits.
  double spin_us = 500.0;
  double liveness_interval_s = 0.05;           //!< how often a sleeping wait checks the peer process
  std::uint64_t inline_max_bytes = 64 * 1024;  //!< sends up to this size may be copied by the posting thread
  std::vector<std::string> dtype_names;        //!< optional names of dtype codes, for error messages
  bool single_copy = true;                     //!< allow the process_vm_readv path (receiver probes, both must allow)
  std::uint64_t single_copy_min_bytes = 256 * 1024;  //!< sends of at least this size use it (>= 1)
  //! > 0: a receive of at most inline_max_bytes is its waiter's to copy (the worker
  //! takes one over only when its waiter stops spinning), and the worker looks
  //! every recv_poll_ms for ones nobody waits on. 0: the worker watches the ring
  //! for every posted receive (each publish wakes it).
  double recv_poll_ms = 20.0;

  //! Throws std::invalid_argument naming the violated constraint.
  void validate() const;
};

//! Payload bytes per chunk the sender uses for a message of `nbytes`: at most
//! one slot, smaller for mid-sized messages so that they are still pipelined.
std::uint64_t pipeline_chunk_bytes(std::uint64_t nbytes, std::uint64_t slot_bytes);

//! A fresh ring segment for the pair src -> dst, initialised and mapped.
std::shared_ptr<ShmSegment> create_ring_segment(const ChannelConfig& cfg, int src_rank, int dst_rank);

class Channel {
 public:
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  virtual ~Channel() = default;

  //! Stop the worker, fail every unfinished request, mark our end closed.
  //! Idempotent. Derived destructors call it. In a forked child (which has no
  //! worker thread and is not the ring's owner) it only forgets the thread.
  void close();
  //! Fail every unfinished request with `why` (the one being copied too, at its next ring wait) and
  //! every later post, and wake whoever sleeps on the ring; the first call's text sticks. The
  //! channel stays open (close() still tears it down); the peer is not told. Never blocks long.
  void fail_all(const std::string& why);

  int self_rank() const { return self_rank_; }
  int peer_rank() const { return peer_rank_; }
  //! The peer's pid from the ring header (0 until the peer attached).
  int peer_pid() const;
  //! True once the receiver's probe allowed single-copy reads on this ring and our config allows them.
  bool single_copy_active() const;
  const std::shared_ptr<ShmSegment>& segment() const { return segment_; }

 protected:
  Channel(Side side, std::shared_ptr<ShmSegment> segment, int self_rank, int peer_rank, ChannelConfig cfg);

  //! Wait until ready() holds. Returns "" or why it never will (closed, peer dead, ring broken).
  //! `spin`: spin up to spin_us first (false: sleep at once, e.g. when another thread polls too).
  template <class Ready>
  std::string wait_ring(std::atomic<std::uint32_t>* word, std::atomic<std::uint32_t>* waiters, Ready ready,
                        bool spin = true);
  //! Fail a just-posted `req` if the channel is closed or broken; true if it did. Caller holds mu_.
  bool fail_if_unusable_locked(Request& req) const;
  //! Start the worker thread if needed. Caller holds mu_.
  void ensure_worker();
  //! Worker only, holding `lk` and finding nothing to do: spin up to min(spin_us, kWorkerSpinUs) for a new
  //! post before the caller sleeps on cv_ (a back-to-back post then costs no wake-up).
  //! Returns with `lk` held again.
  void spin_for_post(std::unique_lock<std::mutex>& lk);
  //! Fail everything still queued (caller holds mu_).
  virtual void fail_pending_locked(const std::string& why) = 0;
  virtual void worker_loop() = 0;
  TransferInfo make_info(Direction d, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                         std::string what) const;
  std::string dtype_name(std::int32_t code) const;
  //! Wake the peer if it sleeps on `word` (after we stored a new value to it).
  static void wake_if_waiting(std::atomic<std::uint32_t>* word, std::atomic<std::uint32_t>* waiters);

  const Side side_;
  const std::shared_ptr<ShmSegment> segment_;
  const RingView ring_;
  const int self_rank_;
  const int peer_rank_;
  const ChannelConfig cfg_;

  std::mutex mu_;
  std::condition_variable cv_;     // worker sleeps here when it has nothing to do
  std::atomic<bool> stop_{false};  // read by the worker inside ring waits without mu_
  std::atomic<bool> failed_{false};  // set once by fail_all(), after failure_; read by ring waits without mu_
  std::string failure_;            // written once (under mu_) before failed_ is set, then read-only
  std::atomic<std::uint32_t> post_count_{0};  // bumped (under mu_) by every post the worker must serve
  bool closed_ = false;            // guarded by mu_
  bool busy_ = false;              // guarded by mu_: the worker is running a request
  std::string broken_;             // guarded by mu_: once set, every new post fails with it
  std::thread worker_;
  const int owner_pid_;            // a forked child inherits the object but not the thread or the ring role
};

class SendChannel;

//! One ring slot held between SendChannel::reserve() and commit() / abort(). One owner,
//! not thread-safe. It must not outlive its channel (Engine::reserve keeps the channel
//! alive through keep_alive()); the slot memory stays mapped while it exists.
class SlotReservation {
 public:
  SlotReservation(const SlotReservation&) = delete;
  SlotReservation& operator=(const SlotReservation&) = delete;
  ~SlotReservation();  //!< abort() unless committed or aborted

  //! The slot's payload bytes (nbytes() of them), writable until commit() or abort().
  unsigned char* data() const { return data_; }
  std::uint64_t nbytes() const { return info_.nbytes; }
  const TransferInfo& info() const { return info_; }
  bool open() const { return open_; }
  //! Publish the slot as one message. Throws std::runtime_error naming the transfer if the
  //! channel was closed or broke meanwhile (nothing is published then). Releases the slot
  //! either way; a second call throws std::logic_error.
  void commit();
  //! Give the slot back unpublished. Idempotent; no-op after commit().
  void abort();
  //! Keep `owner` (e.g. the channel's shared_ptr) alive as long as this reservation.
  void keep_alive(std::shared_ptr<const void> owner) { owner_ = std::move(owner); }

 private:
  friend class SendChannel;
  SlotReservation(SendChannel* ch, unsigned char* data, TransferInfo info)
      : ch_(ch), data_(data), info_(std::move(info)) {}

  SendChannel* ch_;
  unsigned char* data_;
  TransferInfo info_;
  bool open_ = true;
  std::shared_ptr<const void> owner_;
};

//! Counters of one send channel (bytes the engine itself copied into the ring vs bytes
//! callers wrote into reserved slots), for tests and benchmarks.
struct SendStats {
  std::uint64_t copied_bytes = 0;       //!< memcpy'd into ring slots by post() / the worker
  std::uint64_t copied_messages = 0;    //!< messages posted (ring or single-copy)
  std::uint64_t reserved_bytes = 0;     //!< committed from reserved slots (no engine copy)
  std::uint64_t reserved_messages = 0;  //!< reservations committed
};

class SendChannel final : public Channel {
 public:
  SendChannel(std::shared_ptr<ShmSegment> segment, int self_rank, int peer_rank, ChannelConfig cfg);
  ~SendChannel() override;

  //! Post a send of `nbytes` bytes at `src` (the caller keeps it alive and
  //! unmodified until the request completes).
  std::shared_ptr<Request> post(const void* src, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                std::string what = "");
  //! Reserve the next ring slot for a one-chunk message of `nbytes` (<= slot_bytes, else
  //! std::invalid_argument). Waits up to `wait_s` (0: only try) for the queued and running
  //! sends to finish and for a free slot; returns nullptr if that time passed, with the
  //! reason (naming the transfer and the peer's state) in `*why_not` if given. Throws
  //! std::runtime_error naming the transfer if the channel is closed or broken or the peer died.
  std::unique_ptr<SlotReservation> reserve(std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                           std::string what, double wait_s, std::string* why_not = nullptr);
  SendStats stats() const;
  //! One piece of a gathered message: `nbytes` bytes at `src` go to byte `offset` of the message.
  struct Piece {
    std::uint64_t offset;
    const void* src;
    std::uint64_t nbytes;
  };
  //! Write a one-chunk message of `nbytes` made of `pieces` (in increasing offset order, not
  //! overlapping; the bytes between them are zero) straight into the next ring slot and publish
  //! it, if that can be done at once: nothing queued or running, a free slot, at most
  //! inline_max_bytes and slot_bytes. True: sent and complete (the receiver posts an ordinary
  //! receive of `nbytes` with `dtype`). False: nothing was written (post() it instead, which also
  //! reports a closed or broken channel). std::invalid_argument for pieces outside the message.
  bool try_post_gather(const std::vector<Piece>& pieces, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype);

 private:
  friend class SlotReservation;
  void worker_loop() override;
  void fail_pending_locked(const std::string& why) override;
  //! Whether a message of `nbytes` may be written into the next slot by the calling thread now: nothing
  //! queued or running, at most inline_max_bytes and slot_bytes, a free slot, the ring not broken.
  //! Caller holds mu_.
  bool inline_slot_free_locked(std::uint64_t nbytes) const;
  //! Take the busy token once nothing is queued or running, by `deadline`; "" / "timeout" / the error.
  std::string take_token_until(std::chrono::steady_clock::time_point deadline, const TransferInfo& info);
  //! Give the busy token back and wake the worker and other reservers.
  void release_token();
  //! SlotReservation::commit(): publish the reserved slot; "" or the error. Releases the token.
  std::string commit_reserved(const TransferInfo& info);
  //! Fill the header of the slot of chunk head_ (a payload chunk of n bytes at `offset`).
  void fill_header(const TransferInfo& info, std::uint64_t offset, std::uint64_t n, ChunkKind kind);
  //! Publish chunk head_ (head_ + 1) and wake a sleeping receiver.
  void publish();
  //! Copy the whole message into the ring; "" or the error. Caller owns the "busy" token.
  std::string run(Request& req);
  //! Write one chunk into the next slot (a free slot must exist) and publish it.
  void write_chunk(const Request& req, std::uint64_t offset, std::uint64_t n);
  //! Publish a descriptor of the whole message and wait for the receiver's read; "" or the error.
  std::string run_single_copy(Request& req);

  std::deque<std::shared_ptr<Request>> queue_;  // guarded by mu_
  std::uint64_t head_ = 0;                      // chunks published (64-bit); owned by the busy-token holder
  std::uint64_t next_seq_ = 0;                  // owned by the busy-token holder
  std::atomic<std::uint64_t> copied_bytes_{0}, copied_messages_{0}, reserved_bytes_{0}, reserved_messages_{0};
};

class RecvChannel final : public Channel, public std::enable_shared_from_this<RecvChannel> {
 public:
  RecvChannel(std::shared_ptr<ShmSegment> segment, int self_rank, int peer_rank, ChannelConfig cfg);
  ~RecvChannel() override;

  //! Post a receive of exactly `nbytes` bytes into `dst` (written by the engine
  //! until the request completes; never written if the message does not match).
  std::shared_ptr<Request> post(void* dst, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                std::string what = "");
  //! Messages received before any matching receive was posted (diagnostics).
  std::size_t stashed() const;
  //! Called by a thread waiting on one of our receives: if a whole one-chunk
  //! message of at most inline_max_bytes sits at the ring's tail and nobody
  //! holds the busy token, receive it on this thread. Never blocks; true if it
  //! received a message.
  bool poll_ready();

 private:
  struct Stashed {
    std::int64_t tag;
    std::uint64_t nbytes;
    std::int32_t dtype;
    std::vector<unsigned char> data;
  };

  void worker_loop() override;
  void fail_pending_locked(const std::string& why) override;
  //! Receive the message at the ring's tail; "" or the error.
  std::string receive_one();
  //! Copy the message whose first chunk header is `first` into dst (nullptr only when nbytes == 0).
  std::string drain(const SlotHeader& first, unsigned char* dst, Request* progress);
  //! drain() for a descriptor chunk: read the sender's memory, then release the slot.
  std::string read_remote(const SlotHeader& first, unsigned char* dst, Request* progress);
  //! Read bytes [begin, end) of the sender's message into dst + begin; "" or the error (not recorded in the ring).
  std::string read_range(const RemoteDescriptor& d, std::uint64_t begin, std::uint64_t end, unsigned char* dst,
                         Request* progress, std::uint64_t nbytes);
  //! Attach-time probe: may we read the sender's memory? Publishes the verdict in the ring header.
  void probe_single_copy();
  //! "" if a message (nbytes, dtype) may land in `req`, else the mismatch text.
  std::string check_match(const Request& req, std::uint64_t nbytes, std::int32_t dtype) const;
  //! Whether the message at the ring's tail is tagged `tag`, `nbytes` long and all in one published
  //! payload chunk (so a posting thread may receive it without waiting). Caller holds mu_, !busy_.
  bool whole_message_ready_locked(std::int64_t tag, std::uint64_t nbytes) const;
  //! Whether the message at the ring's tail is whole in one published payload chunk of at most
  //! inline_max_bytes (any tag). Caller holds mu_, !busy_.
  bool small_message_ready_locked() const;
  //! Earliest posted receive with `tag`, removed from posted_ (caller holds mu_), or null.
  std::shared_ptr<Request> take_posted_locked(std::int64_t tag);
  //! Mark the channel broken: fail `req` and everything posted, tell the sender.
  void break_channel(const std::shared_ptr<Request>& req, const std::string& why);

  //! Whether the worker must watch the ring itself (woken by each publish): recv_poll_ms is 0, a
  //! posted receive is larger than inline_max_bytes, or a waiter handed its receive over (engaged_).
  //! Otherwise every posted receive is small and its waiter copies it (poll_ready, block_for_message),
  //! so the worker only looks every recv_poll_ms (a receive nobody waits on still completes) and no
  //! publish or post wakes it.
  bool eager_locked() const;
  static constexpr int kLazyIdlePolls = 5;  //!< lazy looks with nothing posted before an untimed sleep
  //! The engage hook of small receive `req` (see Request::set_engage; set when recv_poll_ms > 0): watch
  //! the ring while it is posted.
  void engage(const Request* req);
  //! The block hook of a small receive (see Request::set_block): copy what has landed, else sleep on the
  //! ring's head until the sender publishes (at most min(slice_s, liveness_interval_s)). False when the
  //! waiter cannot help: the channel is closed or broken, another thread is copying, a chunk it cannot
  //! copy waits at the tail, or a whole sleep passed without a publish.
  bool block_for_message(double slice_s);

  std::deque<std::shared_ptr<Request>> posted_;  // guarded by mu_
  std::size_t large_posted_ = 0;                 // guarded by mu_: posted receives > inline_max_bytes
  std::vector<const Request*> engaged_;          // guarded by mu_: posted small receives whose waiters sleep
  bool worker_idle_ = false;                     // guarded by mu_: the worker sleeps until notified
  std::deque<Stashed> stash_;                    // guarded by mu_
  std::uint64_t tail_ = 0;                       // chunks drained (64-bit); owned by the busy-token holder
  std::uint64_t next_seq_ = 0;                   // owned by the busy-token holder
};

}  // namespace dualpipe::shm
