// CUDA IPC comm engine, host logic: ops, construction, rendezvous, posting.
// The worker's progress and the teardown are in ipc_worker.cpp; every CUDA
// call goes through DeviceApi. See ipc_engine.h for the protocol.
#include "cuda/ipc_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/errors.h"
#include "common/liveness.h"
#include "common/poll.h"
#include "common/msg.h"

namespace dualpipe::cuda {

using Clock = std::chrono::steady_clock;

namespace {

std::string human_bytes(std::uint64_t b) {
  Msg os;
  if (b >= (1ull << 20) && b % (1ull << 20) == 0) {
    os << (b >> 20) << " MiB";
  } else if (b >= (1ull << 10) && b % (1ull << 10) == 0) {
    os << (b >> 10) << " KiB";
  } else {
    os << b << " B";
  }
  return os.str();
}

std::string pid_state(int pid) {
  if (pid <= 0) return "unknown";
  const std::string dead = process_dead_reason(pid);
  return dead.empty() ? "alive" : dead;
}

}  // namespace

void check(DeviceApi& api, Status s, const char* call) {
  if (s == kOk) return;
  throw std::runtime_error(std::string(call) + " failed: " + api.error_text(s));
}

bool finished(DeviceApi& api, Status s, const char* call) {
  if (s == kOk) return true;
  if (s == kNotReady) return false;
  check(api, s, call);
  return false;
}

DeviceGuard::DeviceGuard(DeviceApi& api, int device) : api_(api) {
  check(api_, api_.get_device(&previous_), "cudaGetDevice");
  if (previous_ != device) check(api_, api_.set_device(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (api_.get_device(&now) == kOk && now != previous_) api_.set_device(previous_);
}

// ---------------------------------------------------------------------------
// Engine: construction and rendezvous
// ---------------------------------------------------------------------------

Engine::Engine(std::shared_ptr<DeviceApi> api, int rank, int device, const EngineOptions& options)
    : api_(std::move(api)), rank_(rank), device_(device), options_(options) {
  if (api_ == nullptr) throw std::invalid_argument("the CUDA IPC engine needs a device layer");
  if (options.num_slots < 2 || options.num_slots > kMaxSlots) {
    throw std::invalid_argument("num_slots must be in [2, " + std::to_string(kMaxSlots) + "], got " +
                                std::to_string(options.num_slots));
  }
  if (options.slot_bytes == 0 || options.slot_bytes % kChunkAlignment != 0) {
    throw std::invalid_argument("slot_bytes must be a positive multiple of 256, got " +
                                std::to_string(options.slot_bytes));
  }
  if (options.max_peer_mappings < 1 || options.max_peer_mappings > static_cast<std::uint32_t>(kMaxExports)) {
    throw std::invalid_argument("max_peer_mappings must be in [1, " + std::to_string(kMaxExports) + "], got " +
                                std::to_string(options.max_peer_mappings));
  }
  if (options.max_inflight < 1 || options.max_inflight > kMaxInflight) {
    throw std::invalid_argument("max_inflight must be in [1, " + std::to_string(kMaxInflight) + "], got " +
                                std::to_string(options.max_inflight));
  }
  int count = 0;
  check(*api_, api_->device_count(&count), "cudaGetDeviceCount");
  if (device < 0 || device >= count) {
    throw std::invalid_argument("device " + std::to_string(device) + " out of range: " + std::to_string(count) +
                                " CUDA device(s) visible");
  }
  sweep_stale_segments();  // what crashed engines (either kind) left behind
  DeviceGuard guard(*api_, device_);
  const bool some = options.send_stream != nullptr || options.recv_stream != nullptr || options.done_stream != nullptr;
  const bool all = options.send_stream != nullptr && options.recv_stream != nullptr && options.done_stream != nullptr;
  if (some && !all) throw std::invalid_argument("pass send_stream, recv_stream and done_stream, or none");
  if (all) {
    if (options.send_stream == options.recv_stream || options.send_stream == options.done_stream ||
        options.recv_stream == options.done_stream) {
      throw std::invalid_argument("send_stream, recv_stream and done_stream must be three different streams");
    }
    send_stream_ = options.send_stream;
    recv_stream_ = options.recv_stream;
    done_stream_ = options.done_stream;
    owns_streams_ = false;
  } else {
    Stream* mine[] = {&send_stream_, &recv_stream_, &done_stream_};
    for (Stream* s : mine) {
      const Status r = api_->stream_create(s);
      if (r == kOk) continue;
      for (Stream* t : mine) {
        if (*t != nullptr) api_->stream_destroy(*t);
      }
      check(*api_, r, "cudaStreamCreateWithPriority(comm stream)");
    }
  }
  // Two events per op in flight (a full descriptor ring each way), made here once.
  pool_ = std::make_shared<EventPool>(api_, 4 * static_cast<std::size_t>(options.max_inflight) + 64);
  worker_ = std::thread([this] { worker_main(); });
}

Engine::~Engine() {
  try {
    close(5.0);
  } catch (...) {
    // never throw from a destructor; close() already released what it could
  }
}

std::string Engine::peer_dead_reason(int pid) const {
  if (pid <= 0) return "";
  return options_.peer_dead_reason ? options_.peer_dead_reason(pid) : process_dead_reason(pid);
}

Channel& Engine::channel_locked(int peer, bool outgoing) {
  auto& map = outgoing ? outgoing_ : incoming_;
  auto it = map.find(peer);
  if (it == map.end()) {
    throw std::invalid_argument("rank " + std::to_string(rank_) + ": no " + (outgoing ? "outgoing" : "incoming") +
                                " channel with peer " + std::to_string(peer) +
                                " (peer not in the transport's peer list, or rendezvous not done)");
  }
  return *it->second;
}

const Channel& Engine::channel_locked(int peer, bool outgoing) const {
  return const_cast<Engine*>(this)->channel_locked(peer, outgoing);
}

// Receiver, ipc staging: a device ring with its signal block, exported. Under
// Staging::kAuto a failure to export it falls back to host staging
// (ch.staging becomes kHost) instead of failing.
void Engine::make_device_ring(Channel& ch, IpcMemHandle* ring_handle) {
  const std::uint64_t used = ch.ring_bytes + kSignalBytes;
  const std::uint64_t alloc_bytes = (used + kRingAlignment - 1) / kRingAlignment * kRingAlignment;
  check(*api_, api_->malloc(reinterpret_cast<void**>(&ch.slots), alloc_bytes), "cudaMalloc(ring)");
  ch.slots_device_owned = true;
  ch.signals = ch.slots + ch.ring_bytes;
  check(*api_, api_->set_value(ch.ready_signal(), ch.base), "set_value(ready signal)");
  check(*api_, api_->set_value(ch.freed_signal(), ch.base), "set_value(freed signal)");
  const Status r = api_->ipc_get_mem_handle(ring_handle, ch.slots);
  if (r == kOk) return;
  const std::string failure = "cudaIpcGetMemHandle(ring) failed: " + api_->error_text(r);
  if (options_.staging != Staging::kAuto) {
    throw IpcUnavailable("rank " + std::to_string(rank_) + ": " + failure +
                         "; CUDA IPC is not possible in this process, use staging='host'");
  }
  check(*api_, api_->free(ch.slots), "cudaFree(ring)");  // IPC unsupported here: fall back to host staging
  ch.slots = nullptr;
  ch.signals = nullptr;
  ch.slots_device_owned = false;
  ch.staging = Staging::kHost;
}

std::string Engine::create_incoming(int src) {
  std::lock_guard<std::mutex> rk(rendezvous_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": engine is closed");
    if (src == rank_) throw std::invalid_argument("a rank cannot open a channel to itself");
    if (incoming_.count(src)) {
      throw std::invalid_argument("incoming channel from peer " + std::to_string(src) + " exists");
    }
  }
  DeviceGuard guard(*api_, device_);

  auto owned = std::make_unique<Channel>();
  Channel& ch = *owned;
  ch.peer = src;
  ch.outgoing = false;
  ch.num_slots = options_.num_slots;
  ch.slot_bytes = options_.slot_bytes;
  ch.ring_bytes = static_cast<std::uint64_t>(ch.num_slots) * ch.slot_bytes;
  ch.inflight = static_cast<std::uint64_t>(options_.max_inflight);
  ch.base = options_.counter_base;
  ch.next_chunk = ch.base;
  ch.staging = options_.staging == Staging::kHost ? Staging::kHost : Staging::kIpc;
  IpcMemHandle ring_handle{};
  try {
    if (ch.staging == Staging::kIpc) make_device_ring(ch, &ring_handle);
    const bool ipc = ch.staging == Staging::kIpc;
    // The segment: control block, then (host staging) the ring.
    ch.segment = ShmSegment::create("cuda-" + std::to_string(src) + "to" + std::to_string(rank_),
                                    ring_offset() + (ipc ? 0 : ch.ring_bytes));
    ch.ctl = new (ch.segment.data()) CtlBlock();
    CtlBlock& c = *ch.ctl;
    c.version = kVersion;
    c.staging = static_cast<std::int32_t>(ch.staging);
    c.num_slots = ch.num_slots;
    c.src_rank = src;
    c.dst_rank = rank_;
    c.receiver_pid = static_cast<std::int32_t>(::getpid());
    c.receiver_device = device_;
    c.export_slots = static_cast<std::int32_t>(options_.max_peer_mappings);
    c.inflight = options_.max_inflight;
    c.slot_bytes = ch.slot_bytes;
    c.ring_bytes = ch.ring_bytes;
    c.signal_offset = ch.ring_bytes;
    c.counter_base = ch.base;
    c.published.store(ch.base, std::memory_order_relaxed);
    c.taken.store(ch.base, std::memory_order_relaxed);
    ch.mapped.resize(options_.max_peer_mappings);
    ch.retire_handled.resize(options_.max_peer_mappings);
    c.ring_handle = ring_handle;
    if (!ipc) {
      ch.slots = static_cast<char*>(ch.segment.data()) + ring_offset();
      check(*api_, api_->host_register(ch.slots, ch.ring_bytes), "cudaHostRegister(host ring)");
      ch.host_registered = true;
    }
    std::atomic_thread_fence(std::memory_order_release);
    c.magic = kMagic;
  } catch (...) {
    release_imports(ch, true);
    release_exports(ch, Clock::now(), true);
    throw;
  }
  const std::string name = ch.segment.name();
  std::lock_guard<std::mutex> lk(mu_);
  incoming_.emplace(src, std::move(owned));
  return name;
}

// Sender, ipc staging: map the receiver's ring (and so its signal block).
void Engine::map_peer_ring(Channel& ch, int dst) {
  CtlBlock& c = *ch.ctl;
  void* ring = nullptr;
  const Status r = api_->ipc_open_mem_handle(&ring, c.ring_handle);
  if (r != kOk) {
    throw IpcUnavailable("rank " + std::to_string(rank_) + ": cudaIpcOpenMemHandle failed: " + api_->error_text(r) +
                         " opening the ring of peer " + std::to_string(dst) +
                         "; CUDA IPC is not possible between these processes, use staging='host'");
  }
  ch.slots = static_cast<char*>(ring);
  ch.slots_ipc_opened = true;
  ch.signals = ch.slots + c.signal_offset;
}

void Engine::attach_outgoing(int dst, const std::string& shm_name) {
  std::lock_guard<std::mutex> rk(rendezvous_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": engine is closed");
    if (outgoing_.count(dst)) {
      throw std::invalid_argument("outgoing channel to peer " + std::to_string(dst) + " exists");
    }
  }
  DeviceGuard guard(*api_, device_);

  auto owned = std::make_unique<Channel>();
  Channel& ch = *owned;
  ch.peer = dst;
  ch.outgoing = true;
  try {
    ch.segment = ShmSegment::open(shm_name);
    // Both sides map the segment now: drop its name, so that nothing is left
    // in /dev/shm whichever process is killed from here on.
    ch.segment.unlink();
    if (ch.segment.size() < ring_offset()) {
      throw std::runtime_error("shared segment " + shm_name + " is too small to hold a control block");
    }
    ch.ctl = static_cast<CtlBlock*>(ch.segment.data());
    CtlBlock& c = *ch.ctl;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (c.magic != kMagic || c.version != kVersion) {
      throw std::runtime_error("shared segment " + shm_name + " is not a dualpipe_kernels CUDA channel (version " +
                               std::to_string(kVersion) + ")");
    }
    if (c.src_rank != rank_ || c.dst_rank != dst) {
      throw std::runtime_error("channel " + shm_name + " connects rank " + std::to_string(c.src_rank) + " -> " +
                               std::to_string(c.dst_rank) + ", expected " + std::to_string(rank_) + " -> " +
                               std::to_string(dst));
    }
    if (c.num_slots < 2 || c.num_slots > kMaxSlots || c.slot_bytes == 0 || c.slot_bytes % kChunkAlignment != 0 ||
        c.ring_bytes != static_cast<std::uint64_t>(c.num_slots) * c.slot_bytes || c.export_slots < 1 ||
        c.export_slots > kMaxExports || c.inflight < 1 || c.inflight > kMaxInflight) {
      throw std::runtime_error("channel " + shm_name + " has an invalid ring geometry, descriptor ring or export table");
    }
    ch.exports.resize(static_cast<std::size_t>(c.export_slots));
    ch.staging = static_cast<Staging>(c.staging);
    ch.num_slots = c.num_slots;
    ch.slot_bytes = c.slot_bytes;
    ch.ring_bytes = c.ring_bytes;
    ch.inflight = static_cast<std::uint64_t>(c.inflight);
    ch.base = c.counter_base;
    ch.next_chunk = ch.base;
    ch.freed_waited = ch.base;
    ch.peer_pid = c.receiver_pid;
    if (ch.staging == Staging::kIpc) {
      map_peer_ring(ch, dst);
    } else {
      if (ch.segment.size() < ring_offset() + ch.ring_bytes) {
        throw std::runtime_error("shared segment " + shm_name + " is too small for its host ring");
      }
      ch.slots = static_cast<char*>(ch.segment.data()) + ring_offset();
      check(*api_, api_->host_register(ch.slots, ch.ring_bytes), "cudaHostRegister(host ring)");
      ch.host_registered = true;
    }
    c.sender_pid.store(static_cast<std::int32_t>(::getpid()), std::memory_order_relaxed);
    c.sender_attached.store(1, std::memory_order_release);
  } catch (...) {
    release_imports(ch, true);
    release_exports(ch, Clock::now(), true);
    throw;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    ch.ready = true;
    outgoing_.emplace(dst, std::move(owned));
    channels_changed_ = true;
  }
  cv_.notify_all();
}

void Engine::finish_incoming(int src) {
  std::lock_guard<std::mutex> rk(rendezvous_mu_);
  Channel* chp = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": engine is closed");
    chp = &channel_locked(src, false);
    if (chp->ready) return;
  }
  Channel& ch = *chp;  // not ready: the worker does not touch it yet
  CtlBlock& c = *ch.ctl;
  if (c.sender_attached.load(std::memory_order_acquire) == 0) {
    throw std::runtime_error("rank " + std::to_string(rank_) + ": peer " + std::to_string(src) +
                             " has not attached to its channel " + ch.segment.name());
  }
  ch.peer_pid = c.sender_pid.load(std::memory_order_relaxed);
  ch.segment.unlink();  // normally gone already: the sender unlinks it once mapped
  {
    std::lock_guard<std::mutex> lk(mu_);
    ch.ready = true;
    channels_changed_ = true;
  }
  cv_.notify_all();
}

std::string Engine::channel_staging(int peer, bool outgoing) const {
  std::lock_guard<std::mutex> lk(mu_);
  return channel_locked(peer, outgoing).staging == Staging::kIpc ? "ipc" : "host";
}

std::string Engine::channel_status(int peer, bool outgoing) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Channel& ch = channel_locked(peer, outgoing);
  Msg os;
  os << "channel " << (outgoing ? rank_ : peer) << "->" << (outgoing ? peer : rank_) << " ("
     << (ch.staging == Staging::kIpc ? "ipc" : "host") << ", ring " << human_bytes(ch.ring_bytes) << " in chunks of "
     << human_bytes(ch.slot_bytes) << ", " << ch.inflight << " in flight at most";
  if (ch.ctl != nullptr) {
    const int peer_pid = outgoing ? ch.ctl->receiver_pid : ch.ctl->sender_pid.load();
    os << ", published " << ch.ctl->published.load() - ch.base << ", taken " << ch.ctl->taken.load() - ch.base
       << ", next chunk " << ch.status_next_chunk.load() - ch.base << ", "
       << ch.status_queued.load() + ch.inbox.size() << " op(s) queued, peer pid " << peer_pid << " "
       << pid_state(peer_pid);
    if (ch.status_dead.load()) os << " (peer died: its ops failed)";
  }
  if (!engine_error_.empty()) os << ", engine error: " << engine_error_;
  os << ")";
  return os.str();
}

std::pair<std::uint64_t, std::uint64_t> Engine::host_counters(int peer, bool outgoing) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Channel& ch = channel_locked(peer, outgoing);
  if (ch.ctl == nullptr) return {0, 0};
  return {ch.ctl->published.load(std::memory_order_acquire), ch.ctl->taken.load(std::memory_order_acquire)};
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  EngineStats s = stats_;
  s.events_created = pool_ != nullptr ? pool_->created() : 0;
  return s;
}

void Engine::fail_all(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_ || !engine_error_.empty()) return;
    engine_error_ = why;  // posts throw it; the worker fails every channel's ops with it
    ++posted_;  // wakes the worker
  }
  cv_.notify_all();
}

std::shared_ptr<Op> Engine::post(OpKind kind, int peer, std::int64_t tag, void* ptr, std::uint64_t bytes,
                                 const std::string& dtype, Stream caller_stream, std::shared_ptr<void> keepalive,
                                 void* alloc_base, std::uint64_t alloc_bytes) {
  if (bytes > 0 && ptr == nullptr) throw std::invalid_argument("null buffer with a non-zero size");
  TransferInfo info;
  info.direction = kind == OpKind::kSend ? Direction::kSend : Direction::kRecv;
  info.self_rank = rank_;
  info.peer_rank = peer;
  info.tag = tag;
  info.nbytes = bytes;
  info.dtype_name = dtype.substr(0, kDtypeNameLen - 1);
  auto op = std::make_shared<Op>(pool_, std::move(info), static_cast<char*>(ptr));
  op->keepalive_ = std::move(keepalive);
  if (alloc_base != nullptr && alloc_base <= ptr) {
    op->alloc_base_ = static_cast<char*>(alloc_base);
    op->alloc_bytes_ = alloc_bytes;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);  // checked before any device call, so a closed engine is said so
    if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": transport is closed");
    if (!engine_error_.empty()) throw std::runtime_error(engine_error_);
    Channel& ch = channel_locked(peer, kind == OpKind::kSend);
    if (!ch.ready) {
      throw std::runtime_error("rank " + std::to_string(rank_) + ": channel with peer " + std::to_string(peer) +
                               " is not ready (rendezvous not finished)");
    }
  }
  {
    DeviceGuard guard(*api_, device_);
    op->ready_event_ = pool_->take();
    op->done_event_ = pool_->take();
    // Recorded here, in the posting thread, so it captures exactly the work
    // queued on the caller's stream before the post.
    check(*api_, api_->event_record(op->ready_event_, caller_stream), "cudaEventRecord(ready_event)");
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": transport is closed");
    channel_locked(peer, kind == OpKind::kSend).inbox.push_back(op);
    ++posted_;
  }
  cv_.notify_all();
  return op;
}

}  // namespace dualpipe::cuda
