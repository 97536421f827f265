// CUDA IPC comm engine: see ipc_engine.h for the protocol.
//
// Host code only (copies run on copy engines through cudaMemcpyAsync, no
// kernels), compiled by nvcc in CUDA builds. Every CUDA call is checked and
// an error becomes a std::runtime_error that names the call.
#include "ipc_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace dualpipe::cuda {

// ---------------------------------------------------------------------------
// Shared control block
// ---------------------------------------------------------------------------

namespace {

constexpr uint64_t kMagic = 0x31304350494B5044ull;  // "DPKIPC01" read as little-endian bytes
constexpr uint32_t kVersion = 2;
constexpr size_t kMaxOpened = 32;  // receiver: peer allocations kept open for zero-copy
constexpr size_t kPage = 4096;

using Clock = std::chrono::steady_clock;

}  // namespace

// Descriptor of the chunk currently held by one slot (written by the sender
// before it publishes the chunk; read by the receiver after it sees it).
struct ChunkDesc {
  uint64_t msg_seq;      // message number on this channel, from 0
  int64_t tag;           // the sender's tag
  uint64_t total_bytes;  // size of the whole message
  uint64_t offset;       // byte offset of this chunk in the message
  uint64_t bytes;        // bytes in this chunk (<= slot_bytes unless direct)
  char dtype[kDtypeNameLen];
  uint32_t direct;                 // 1: zero-copy, the data is at src_handle + src_offset, not in the slot
  uint32_t reserved;
  uint64_t src_offset;
  uint64_t src_base;  // sender's address of the allocation (cache key when handles differ)
  cudaIpcMemHandle_t src_handle;
};

// Lives at the start of the receiver-created shared segment. Fields above the
// atomics are written once by the receiver before it publishes the segment
// name (ready_events: once by the sender before sender_attached).
struct CtlBlock {
  uint64_t magic;
  uint32_t version;
  int32_t staging;  // Staging::kIpc or kHost
  int32_t num_slots;
  int32_t src_rank;
  int32_t dst_rank;
  int32_t receiver_pid;
  int32_t receiver_device;
  int32_t reserved;
  uint64_t slot_bytes;
  cudaIpcMemHandle_t ring_handle;
  cudaIpcEventHandle_t free_events[kMaxSlots];
  cudaIpcEventHandle_t ready_events[kMaxSlots];
  alignas(64) std::atomic<int32_t> sender_pid;
  std::atomic<uint32_t> sender_attached;
  alignas(64) std::atomic<uint64_t> published;
  alignas(64) std::atomic<uint64_t> freed;
  alignas(64) std::atomic<uint32_t> sender_detached;
  std::atomic<uint32_t> receiver_detached;
  alignas(64) ChunkDesc desc[kMaxSlots];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters need lock-free 64-bit atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory flags need lock-free 32-bit atomics");

namespace {

size_t ring_offset() { return (sizeof(CtlBlock) + kPage - 1) / kPage * kPage; }

std::string errno_message(const char* call, const std::string& what) {
  return std::string(call) + "(" + what + ") failed: " + std::strerror(errno);
}

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DPK_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) DPK_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// "alive", "exited" or "unknown" for a process id on this host.
const char* pid_state(int pid) {
  if (pid <= 0) return "unknown";
  if (::kill(pid, 0) == 0 || errno == EPERM) return "alive";
  return errno == ESRCH ? "exited" : "unknown";
}

bool pid_exited(int pid) { return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH; }

std::string random_suffix() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << rd() << rd();
  return os.str();
}

std::string human_bytes(uint64_t b) {
  std::ostringstream os;
  if (b >= (1ull << 20) && b % (1ull << 20) == 0) {
    os << (b >> 20) << " MiB";
  } else if (b >= (1ull << 10) && b % (1ull << 10) == 0) {
    os << (b >> 10) << " KiB";
  } else {
    os << b << " B";
  }
  return os.str();
}

// Non-blocking query: true when done, false when still running, throws on error.
bool event_done(cudaEvent_t ev, const char* what) {
  cudaError_t r = cudaEventQuery(ev);
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) return false;
  check_cuda(r, what, __FILE__, __LINE__);
  return false;
}

// Sleeps a little longer the longer a poll has waited (keeps latency low for
// short waits without burning a core on long ones).
void backoff(Clock::duration waited) {
  if (waited < std::chrono::microseconds(200)) {
    std::this_thread::yield();
  } else if (waited < std::chrono::milliseconds(10)) {
    std::this_thread::sleep_for(std::chrono::microseconds(10));
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace

void check_cuda(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so later unrelated calls do not report it
  std::string call(expr);
  const size_t paren = call.find('(');
  if (paren != std::string::npos) call.resize(paren);
  const char* base = std::strrchr(file, '/');
  std::ostringstream os;
  os << call << " failed: " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ") at "
     << (base ? base + 1 : file) << ":" << line;
  throw std::runtime_error(os.str());
}

// ---------------------------------------------------------------------------
// Op
// ---------------------------------------------------------------------------

Op::Op(OpKind kind, int rank, int peer, int64_t tag, char* ptr, uint64_t bytes, const std::string& dtype)
    : kind_(kind), rank_(rank), peer_(peer), tag_(tag), ptr_(ptr), bytes_(bytes) {
  std::strncpy(dtype_, dtype.c_str(), kDtypeNameLen - 1);
}

Op::~Op() {
  // Destroying an event whose record has not completed is allowed: the driver
  // releases it once the device reaches it.
  if (ready_event_ != nullptr) cudaEventDestroy(ready_event_);
  if (done_event_ != nullptr) cudaEventDestroy(done_event_);
}

bool Op::wait_enqueued(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto settled = [this] { return state_ != State::kPosted; };
  if (timeout_s < 0) {
    cv_.wait(lk, settled);
  } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), settled)) {
    return false;
  }
  if (state_ == State::kFailed) throw std::runtime_error(error_);
  return true;
}

bool Op::wait(double timeout_s) {
  const auto start = Clock::now();
  if (!wait_enqueued(timeout_s)) return false;
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const auto poll_start = Clock::now();
  while (!event_done(done_event_, "cudaEventQuery(done_event)")) {
    if (timeout_s >= 0 && Clock::now() >= deadline) return false;
    backoff(Clock::now() - poll_start);
  }
  return true;
}

bool Op::query() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_ == State::kFailed) return true;
    if (state_ == State::kPosted) return false;
  }
  return event_done(done_event_, "cudaEventQuery(done_event)");
}

bool Op::wait_stream(cudaStream_t stream, double timeout_s) {
  if (!wait_enqueued(timeout_s)) return false;
  DPK_CUDA_CHECK(cudaStreamWaitEvent(stream, done_event_, 0));
  return true;
}

bool Op::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return state_ == State::kFailed;
}

std::string Op::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

std::string Op::describe() const {
  std::ostringstream os;
  os << (kind_ == OpKind::kSend ? "send to" : "receive from") << " peer " << peer_ << " (tag " << tag_ << ", "
     << bytes_ << " bytes of " << dtype_ << ", " << chunks_enqueued_.load() << " chunk(s) enqueued, ";
  std::lock_guard<std::mutex> lk(mu_);
  os << (state_ == State::kPosted ? "waiting for the peer" : state_ == State::kFailed ? "failed" : "enqueued") << ")";
  return os.str();
}

void Op::mark_enqueued() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_ == State::kPosted) state_ = State::kEnqueued;
  }
  cv_.notify_all();
}

void Op::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_ != State::kPosted) return;
    state_ = State::kFailed;
    error_ = why;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------
// Engine: construction and rendezvous
// ---------------------------------------------------------------------------

Engine::Engine(int rank, int device, const EngineOptions& options) : rank_(rank), device_(device), options_(options) {
  if (options.num_slots < 2 || options.num_slots > kMaxSlots) {
    throw std::invalid_argument("num_slots must be in [2, " + std::to_string(kMaxSlots) + "], got " +
                                std::to_string(options.num_slots));
  }
  if (options.slot_bytes == 0 || options.slot_bytes % 256 != 0) {
    throw std::invalid_argument("slot_bytes must be a positive multiple of 256, got " +
                                std::to_string(options.slot_bytes));
  }
  int count = 0;
  DPK_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    throw std::invalid_argument("device " + std::to_string(device) + " out of range: " + std::to_string(count) +
                                " CUDA device(s) visible");
  }
  DeviceGuard guard(device_);
  int least = 0, greatest = 0;
  DPK_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  DPK_CUDA_CHECK(cudaStreamCreateWithPriority(&send_stream_, cudaStreamNonBlocking, greatest));
  cudaError_t r = cudaStreamCreateWithPriority(&recv_stream_, cudaStreamNonBlocking, greatest);
  if (r != cudaSuccess) {
    cudaStreamDestroy(send_stream_);
    check_cuda(r, "cudaStreamCreateWithPriority(recv_stream)", __FILE__, __LINE__);
  }
  worker_ = std::thread([this] { worker_main(); });
}

Engine::~Engine() {
  try {
    close(5.0);
  } catch (...) {
    // never throw from a destructor; close() already released what it could
  }
}

Channel& Engine::channel_locked(int peer, bool outgoing) {
  auto& map = outgoing ? outgoing_ : incoming_;
  auto it = map.find(peer);
  if (it == map.end()) {
    throw std::invalid_argument("rank " + std::to_string(rank_) + ": no " + (outgoing ? "outgoing" : "incoming") +
                                " channel with peer " + std::to_string(peer) +
                                " (peer not in the transport's peer list, or rendezvous not done)");
  }
  return it->second;
}

const Channel& Engine::channel_locked(int peer, bool outgoing) const {
  return const_cast<Engine*>(this)->channel_locked(peer, outgoing);
}

std::string Engine::create_incoming(int src) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("engine is closed");
  if (src == rank_) throw std::invalid_argument("a rank cannot open a channel to itself");
  if (incoming_.count(src)) throw std::invalid_argument("incoming channel from peer " + std::to_string(src) + " exists");
  DeviceGuard guard(device_);

  Channel ch;
  ch.peer = src;
  ch.outgoing = false;
  ch.num_slots = options_.num_slots;
  ch.slot_bytes = options_.slot_bytes;
  ch.staging = options_.staging == Staging::kHost ? Staging::kHost : Staging::kIpc;
  const size_t ring_bytes = static_cast<size_t>(ch.num_slots) * ch.slot_bytes;
  cudaIpcMemHandle_t ring_handle{};
  cudaIpcEventHandle_t event_handles[kMaxSlots]{};

  try {
    if (ch.staging == Staging::kIpc) {
      DPK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ch.slots), ring_bytes));
      ch.slots_device_owned = true;
      cudaError_t r = cudaIpcGetMemHandle(&ring_handle, ch.slots);
      if (r != cudaSuccess && options_.staging == Staging::kAuto) {
        (void)cudaGetLastError();  // IPC unsupported here: fall back to host staging
        DPK_CUDA_CHECK(cudaFree(ch.slots));
        ch.slots = nullptr;
        ch.slots_device_owned = false;
        ch.staging = Staging::kHost;
      } else {
        check_cuda(r, "cudaIpcGetMemHandle(ring)", __FILE__, __LINE__);
      }
    }
    const bool ipc = ch.staging == Staging::kIpc;
    for (int i = 0; i < ch.num_slots; ++i) {
      const unsigned flags = ipc ? (cudaEventDisableTiming | cudaEventInterprocess) : cudaEventDisableTiming;
      DPK_CUDA_CHECK(cudaEventCreateWithFlags(&ch.local_events[i], flags));
      if (ipc) DPK_CUDA_CHECK(cudaIpcGetEventHandle(&event_handles[i], ch.local_events[i]));
    }

    // The segment: control block, then (host staging) the ring.
    ch.shm_size = ring_offset() + (ipc ? 0 : ring_bytes);
    ch.shm_name = "/dpk_cuda_" + std::to_string(::getpid()) + "_" + std::to_string(src) + "to" +
                  std::to_string(rank_) + "_" + random_suffix();
    const int fd = ::shm_open(ch.shm_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error(errno_message("shm_open", ch.shm_name));
    ch.shm_linked = true;
    // posix_fallocate reserves the pages now, so a full /dev/shm is an error
    // here rather than a SIGBUS later.
    const int fr = ::posix_fallocate(fd, 0, static_cast<off_t>(ch.shm_size));
    if (fr != 0) {
      ::close(fd);
      errno = fr;
      throw std::runtime_error(errno_message("posix_fallocate", ch.shm_name + ", " + human_bytes(ch.shm_size)));
    }
    void* base = ::mmap(nullptr, ch.shm_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (base == MAP_FAILED) throw std::runtime_error(errno_message("mmap", ch.shm_name));
    ch.shm_base = base;
    ch.ctl = new (base) CtlBlock();
    CtlBlock& c = *ch.ctl;
    c.version = kVersion;
    c.staging = static_cast<int32_t>(ch.staging);
    c.num_slots = ch.num_slots;
    c.src_rank = src;
    c.dst_rank = rank_;
    c.receiver_pid = static_cast<int32_t>(::getpid());
    c.receiver_device = device_;
    c.slot_bytes = ch.slot_bytes;
    c.ring_handle = ring_handle;
    for (int i = 0; i < kMaxSlots; ++i) c.free_events[i] = event_handles[i];
    if (!ipc) {
      ch.slots = static_cast<char*>(base) + ring_offset();
      DPK_CUDA_CHECK(cudaHostRegister(ch.slots, ring_bytes, cudaHostRegisterPortable));
      ch.host_registered = true;
    }
    std::atomic_thread_fence(std::memory_order_release);
    c.magic = kMagic;
  } catch (...) {
    release_imports(ch, true);
    release_exports(ch, Clock::now(), true);
    throw;
  }
  const std::string name = ch.shm_name;
  incoming_.emplace(src, std::move(ch));
  return name;
}

void Engine::attach_outgoing(int dst, const std::string& shm_name) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("engine is closed");
  if (outgoing_.count(dst)) throw std::invalid_argument("outgoing channel to peer " + std::to_string(dst) + " exists");
  DeviceGuard guard(device_);

  Channel ch;
  ch.peer = dst;
  ch.outgoing = true;
  ch.shm_name = shm_name;
  try {
    const int fd = ::shm_open(shm_name.c_str(), O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error(errno_message("shm_open", shm_name));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw std::runtime_error(errno_message("fstat", shm_name));
    }
    if (static_cast<size_t>(st.st_size) < ring_offset()) {
      ::close(fd);
      throw std::runtime_error("shared segment " + shm_name + " is too small to hold a control block");
    }
    ch.shm_size = static_cast<size_t>(st.st_size);
    void* base = ::mmap(nullptr, ch.shm_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (base == MAP_FAILED) throw std::runtime_error(errno_message("mmap", shm_name));
    ch.shm_base = base;
    ch.ctl = static_cast<CtlBlock*>(base);
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
    if (c.num_slots < 2 || c.num_slots > kMaxSlots || c.slot_bytes == 0) {
      throw std::runtime_error("channel " + shm_name + " has an invalid ring geometry");
    }
    ch.staging = static_cast<Staging>(c.staging);
    ch.num_slots = c.num_slots;
    ch.slot_bytes = c.slot_bytes;
    const size_t ring_bytes = static_cast<size_t>(ch.num_slots) * ch.slot_bytes;
    const bool ipc = ch.staging == Staging::kIpc;
    if (ipc) {
      void* ring = nullptr;
      cudaError_t r = cudaIpcOpenMemHandle(&ring, c.ring_handle, cudaIpcMemLazyEnablePeerAccess);
      if (r != cudaSuccess) {
        (void)cudaGetLastError();
        throw std::runtime_error(std::string("cudaIpcOpenMemHandle failed: ") + cudaGetErrorName(r) + " (" +
                                 cudaGetErrorString(r) + ") opening the ring of peer " + std::to_string(dst) +
                                 "; CUDA IPC is not possible between these processes, use staging='host'");
      }
      ch.slots = static_cast<char*>(ring);
      ch.slots_ipc_opened = true;
      for (int i = 0; i < ch.num_slots; ++i) {
        DPK_CUDA_CHECK(cudaIpcOpenEventHandle(&ch.peer_events[i], c.free_events[i]));
      }
    } else {
      if (ch.shm_size < ring_offset() + ring_bytes) {
        throw std::runtime_error("shared segment " + shm_name + " is too small for its host ring");
      }
      ch.slots = static_cast<char*>(base) + ring_offset();
      DPK_CUDA_CHECK(cudaHostRegister(ch.slots, ring_bytes, cudaHostRegisterPortable));
      ch.host_registered = true;
    }
    for (int i = 0; i < ch.num_slots; ++i) {
      const unsigned flags = ipc ? (cudaEventDisableTiming | cudaEventInterprocess) : cudaEventDisableTiming;
      DPK_CUDA_CHECK(cudaEventCreateWithFlags(&ch.local_events[i], flags));
      if (ipc) DPK_CUDA_CHECK(cudaIpcGetEventHandle(&c.ready_events[i], ch.local_events[i]));
    }
    c.sender_pid.store(static_cast<int32_t>(::getpid()), std::memory_order_relaxed);
    c.sender_attached.store(1, std::memory_order_release);
  } catch (...) {
    release_imports(ch, true);
    release_exports(ch, Clock::now(), true);
    throw;
  }
  ch.ready = true;
  outgoing_.emplace(dst, std::move(ch));
  cv_.notify_all();
}

void Engine::finish_incoming(int src) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("engine is closed");
  Channel& ch = channel_locked(src, false);
  if (ch.ready) return;
  DeviceGuard guard(device_);
  CtlBlock& c = *ch.ctl;
  if (c.sender_attached.load(std::memory_order_acquire) == 0) {
    throw std::runtime_error("rank " + std::to_string(rank_) + ": peer " + std::to_string(src) +
                             " has not attached to its channel " + ch.shm_name);
  }
  if (ch.staging == Staging::kIpc) {
    for (int i = 0; i < ch.num_slots; ++i) {
      DPK_CUDA_CHECK(cudaIpcOpenEventHandle(&ch.peer_events[i], c.ready_events[i]));
    }
  }
  // Both sides have mapped the segment: drop its name so that nothing is left
  // in /dev/shm even if a process is killed later.
  if (ch.shm_linked && ::shm_unlink(ch.shm_name.c_str()) != 0 && errno != ENOENT) {
    throw std::runtime_error(errno_message("shm_unlink", ch.shm_name));
  }
  ch.shm_linked = false;
  ch.ready = true;
  cv_.notify_all();
}

std::string Engine::channel_staging(int peer, bool outgoing) const {
  std::lock_guard<std::mutex> lk(mu_);
  return channel_locked(peer, outgoing).staging == Staging::kIpc ? "ipc" : "host";
}

std::string Engine::channel_status(int peer, bool outgoing) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Channel& ch = channel_locked(peer, outgoing);
  std::ostringstream os;
  os << "channel " << (outgoing ? rank_ : peer) << "->" << (outgoing ? peer : rank_) << " ("
     << (ch.staging == Staging::kIpc ? "ipc" : "host") << ", " << ch.num_slots << " x " << human_bytes(ch.slot_bytes)
     << " slots";
  if (ch.ctl != nullptr) {
    const int peer_pid = outgoing ? ch.ctl->receiver_pid : ch.ctl->sender_pid.load();
    os << ", published " << ch.ctl->published.load() << ", freed " << ch.ctl->freed.load() << ", next chunk "
       << ch.next_chunk << ", " << ch.queue.size() << " op(s) queued, peer pid " << peer_pid << " "
       << pid_state(peer_pid);
  }
  if (!engine_error_.empty()) os << ", engine error: " << engine_error_;
  os << ")";
  return os.str();
}

// ---------------------------------------------------------------------------
// Posting and the worker
// ---------------------------------------------------------------------------

std::shared_ptr<Op> Engine::post(OpKind kind, int peer, int64_t tag, void* ptr, uint64_t bytes,
                                 const std::string& dtype, cudaStream_t caller_stream,
                                 std::shared_ptr<void> keepalive, void* alloc_base) {
  if (bytes > 0 && ptr == nullptr) throw std::invalid_argument("null buffer with a non-zero size");
  auto op = std::make_shared<Op>(kind, rank_, peer, tag, static_cast<char*>(ptr), bytes, dtype);
  op->keepalive_ = std::move(keepalive);
  if (alloc_base != nullptr && alloc_base <= ptr) op->alloc_base_ = static_cast<char*>(alloc_base);
  {
    DeviceGuard guard(device_);
    DPK_CUDA_CHECK(cudaEventCreateWithFlags(&op->ready_event_, cudaEventDisableTiming));
    DPK_CUDA_CHECK(cudaEventCreateWithFlags(&op->done_event_, cudaEventDisableTiming));
    // Recorded here, in the posting thread, so it captures exactly the work
    // queued on the caller's stream before the post.
    DPK_CUDA_CHECK(cudaEventRecord(op->ready_event_, caller_stream));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": transport is closed");
    if (!engine_error_.empty()) throw std::runtime_error(engine_error_);
    Channel& ch = channel_locked(peer, kind == OpKind::kSend);
    if (!ch.ready) {
      throw std::runtime_error("rank " + std::to_string(rank_) + ": channel with peer " + std::to_string(peer) +
                               " is not ready (rendezvous not finished)");
    }
    ch.queue.push_back(op);
  }
  cv_.notify_all();
  return op;
}

bool Engine::retire_pending(Channel& ch) {
  bool progressed = false;
  while (!ch.pending.empty()) {
    const uint64_t n = ch.pending.front();
    const int slot = static_cast<int>(n % ch.num_slots);
    if (!event_done(ch.local_events[slot], "cudaEventQuery(host staging copy)")) break;
    (ch.outgoing ? ch.ctl->published : ch.ctl->freed).store(n + 1, std::memory_order_release);
    ch.pending.pop_front();
    progressed = true;
  }
  return progressed;
}

bool Engine::progress_send(Channel& ch) {
  bool progressed = retire_pending(ch);
  const bool ipc = ch.staging == Staging::kIpc;
  const auto S = static_cast<uint64_t>(ch.num_slots);
  // Zero-copy sends whose chunk the receiver has consumed: its free event
  // follows its copy out of our buffer, so our op is done once that event is.
  // (Should the receiver already have re-recorded the event for a later chunk,
  // the wait binds to that later record: later on the same stream, so still safe.)
  const uint64_t freed_now = ch.ctl->freed.load(std::memory_order_acquire);
  while (!ch.awaiting.empty() && ch.awaiting.front().first < freed_now) {
    const uint64_t n = ch.awaiting.front().first;
    std::shared_ptr<Op> op = std::move(ch.awaiting.front().second);
    ch.awaiting.pop_front();
    DPK_CUDA_CHECK(cudaStreamWaitEvent(send_stream_, ch.peer_events[n % S], 0));
    DPK_CUDA_CHECK(cudaEventRecord(op->done_event_, send_stream_));
    finish_op_locked(*op, "");
    progressed = true;
  }
  while (!ch.queue.empty()) {
    Op& op = *ch.queue.front();
    const uint64_t n = ch.next_chunk;
    if (n >= ch.ctl->freed.load(std::memory_order_acquire) + S) break;  // ring full: wait for the receiver
    const int slot = static_cast<int>(n % S);
    char* slot_ptr = ch.slots + static_cast<size_t>(slot) * ch.slot_bytes;
    if (!op.started_) {
      DPK_CUDA_CHECK(cudaStreamWaitEvent(send_stream_, op.ready_event_, 0));
      op.started_ = true;
      if (ipc && options_.direct_min_bytes > 0 && op.bytes_ >= options_.direct_min_bytes && op.alloc_base_ != nullptr) {
        // Not every allocation can be exported (e.g. expandable segments):
        // those sends take the staged path.
        const cudaError_t r = cudaIpcGetMemHandle(&op.handle_, op.alloc_base_);
        op.direct_ = r == cudaSuccess;
        if (r != cudaSuccess) (void)cudaGetLastError();
      }
    }
    ChunkDesc& d = ch.ctl->desc[slot];
    if (op.direct_) {
      // "the source is ready": recorded after the producer wait above
      DPK_CUDA_CHECK(cudaEventRecord(ch.local_events[slot], send_stream_));
      d.msg_seq = ch.next_msg_seq;
      d.tag = op.tag_;
      d.total_bytes = op.bytes_;
      d.offset = 0;
      d.bytes = op.bytes_;
      std::memcpy(d.dtype, op.dtype_, kDtypeNameLen);
      d.direct = 1;
      d.src_offset = static_cast<uint64_t>(op.ptr_ - op.alloc_base_);
      d.src_base = reinterpret_cast<uint64_t>(op.alloc_base_);
      d.src_handle = op.handle_;
      ch.ctl->published.store(n + 1, std::memory_order_release);
      ++ch.next_chunk;
      op.offset_ = op.bytes_;
      op.chunks_enqueued_.fetch_add(1);
      ch.awaiting.emplace_back(n, std::move(ch.queue.front()));
      ch.queue.pop_front();
      ++ch.next_msg_seq;
      progressed = true;
      continue;
    }
    // The receiver has enqueued the drain of chunk n - S; wait for it on the
    // device before overwriting the slot (host staging: freed means drained).
    if (ipc && n >= S) DPK_CUDA_CHECK(cudaStreamWaitEvent(send_stream_, ch.peer_events[slot], 0));
    const uint64_t bytes = std::min<uint64_t>(ch.slot_bytes, op.bytes_ - op.offset_);
    if (bytes > 0) {
      DPK_CUDA_CHECK(cudaMemcpyAsync(slot_ptr, op.ptr_ + op.offset_, bytes,
                                     ipc ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost, send_stream_));
    }
    DPK_CUDA_CHECK(cudaEventRecord(ch.local_events[slot], send_stream_));
    d.msg_seq = ch.next_msg_seq;
    d.tag = op.tag_;
    d.total_bytes = op.bytes_;
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
    progressed = true;
    if (op.offset_ == op.bytes_) {
      DPK_CUDA_CHECK(cudaEventRecord(op.done_event_, send_stream_));
      finish_op_locked(op, "");
      ch.queue.pop_front();
      ++ch.next_msg_seq;
    }
  }
  return progressed;
}

char* Engine::open_peer_buffer(Channel& ch, const cudaIpcMemHandle_t& handle, uint64_t src_base) {
  const std::string key(reinterpret_cast<const char*>(&handle), sizeof(handle));
  const uint64_t now = ++ch.map_clock;
  for (PeerMapping& m : ch.opened) {
    if (m.key == key) {
      m.last_use = now;
      return m.ptr;
    }
  }
  if (ch.opened.size() >= kMaxOpened) {
    // Unmap the least recently used allocation (with its aliases). Copies
    // from it may still be queued: drain them first (rare).
    auto lru = std::min_element(ch.opened.begin(), ch.opened.end(),
                                [](const PeerMapping& a, const PeerMapping& b) { return a.last_use < b.last_use; });
    char* victim = lru->ptr;
    DPK_CUDA_CHECK(cudaStreamSynchronize(recv_stream_));
    DPK_CUDA_CHECK(cudaIpcCloseMemHandle(victim));
    ch.opened.erase(std::remove_if(ch.opened.begin(), ch.opened.end(),
                                   [victim](const PeerMapping& m) { return m.ptr == victim; }),
                    ch.opened.end());
  }
  void* p = nullptr;
  const cudaError_t r = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
  if (r == cudaErrorAlreadyMapped) {
    // The same allocation, exported again under other handle bytes.
    (void)cudaGetLastError();
    for (const PeerMapping& m : ch.opened) {
      if (src_base != 0 && m.src_base == src_base) {
        char* ptr = m.ptr;
        ch.opened.push_back(PeerMapping{key, src_base, ptr, now});
        return ptr;
      }
    }
  }
  check_cuda(r, "cudaIpcOpenMemHandle(sender buffer)", __FILE__, __LINE__);
  // An older mapping with the same sender address belongs to a freed
  // allocation: never alias to it again.
  for (PeerMapping& m : ch.opened) {
    if (m.src_base == src_base) m.src_base = 0;
  }
  ch.opened.push_back(PeerMapping{key, src_base, static_cast<char*>(p), now});
  return static_cast<char*>(p);
}

bool Engine::progress_recv(Channel& ch) {
  bool progressed = retire_pending(ch);
  const bool ipc = ch.staging == Staging::kIpc;
  const auto S = static_cast<uint64_t>(ch.num_slots);
  while (true) {
    const uint64_t n = ch.next_chunk;
    if (ch.ctl->published.load(std::memory_order_acquire) <= n) break;  // nothing new from the sender
    const int slot = static_cast<int>(n % S);
    ChunkDesc d = ch.ctl->desc[slot];
    d.dtype[kDtypeNameLen - 1] = '\0';
    const bool in_message = ch.current != nullptr || ch.discarding;
    const bool direct = d.direct != 0;
    if (d.msg_seq != ch.next_msg_seq || (!direct && d.bytes > ch.slot_bytes) || d.offset + d.bytes > d.total_bytes ||
        d.offset != (in_message ? ch.msg_offset : 0) || (direct && (!ipc || in_message || d.bytes != d.total_bytes))) {
      throw std::runtime_error("protocol error on channel from peer " + std::to_string(ch.peer) + ": chunk " +
                               std::to_string(n) + " has message " + std::to_string(d.msg_seq) + " offset " +
                               std::to_string(d.offset) + ", expected message " + std::to_string(ch.next_msg_seq) +
                               " offset " + std::to_string(in_message ? ch.msg_offset : 0));
    }
    if (!in_message) {
      auto it = ch.queue.begin();
      while (it != ch.queue.end() && (*it)->tag_ != d.tag) ++it;
      if (it == ch.queue.end()) break;  // no receive posted for this tag yet: leave the chunk in the ring
      std::shared_ptr<Op> op = *it;
      ch.queue.erase(it);
      ch.msg_offset = 0;
      if (op->bytes_ != d.total_bytes || std::strncmp(op->dtype_, d.dtype, kDtypeNameLen) != 0) {
        std::ostringstream os;
        os << "rank " << rank_ << ": size/dtype mismatch: receive from peer " << ch.peer << " (tag " << d.tag
           << ") expects " << op->bytes_ << " bytes of " << op->dtype_ << ", but the peer sent " << d.total_bytes
           << " bytes of " << d.dtype << "; the message was discarded";
        finish_op_locked(*op, os.str());
        ch.discarding = true;
      } else {
        ch.current = op;
        DPK_CUDA_CHECK(cudaStreamWaitEvent(recv_stream_, op->ready_event_, 0));
      }
    }
    if (ipc) DPK_CUDA_CHECK(cudaStreamWaitEvent(recv_stream_, ch.peer_events[slot], 0));
    if (ch.current != nullptr && d.bytes > 0 && direct) {
      char* src = nullptr;
      try {
        src = open_peer_buffer(ch, d.src_handle, d.src_base);
      } catch (const std::exception& e) {
        // Only this receive fails: the message is consumed without a copy.
        finish_op_locked(*ch.current, "rank " + std::to_string(rank_) + ": zero-copy receive from peer " +
                                          std::to_string(ch.peer) + " (tag " + std::to_string(d.tag) +
                                          ") could not map the sender's buffer: " + e.what() +
                                          " (set direct_min_bytes=0 on the sender to disable zero-copy)");
        ch.current.reset();
        ch.discarding = true;
      }
      if (src != nullptr) {
        DPK_CUDA_CHECK(cudaMemcpyAsync(ch.current->ptr_, src + d.src_offset, d.bytes, cudaMemcpyDeviceToDevice,
                                       recv_stream_));
      }
    } else if (ch.current != nullptr && d.bytes > 0) {
      const char* slot_ptr = ch.slots + static_cast<size_t>(slot) * ch.slot_bytes;
      DPK_CUDA_CHECK(cudaMemcpyAsync(ch.current->ptr_ + d.offset, slot_ptr, d.bytes,
                                     ipc ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice, recv_stream_));
    }
    DPK_CUDA_CHECK(cudaEventRecord(ch.local_events[slot], recv_stream_));
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
        DPK_CUDA_CHECK(cudaEventRecord(ch.current->done_event_, recv_stream_));
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

bool Engine::has_pending_work_locked() const {
  for (const auto* map : {&outgoing_, &incoming_}) {
    for (const auto& kv : *map) {
      const Channel& ch = kv.second;
      if (ch.ready && (!ch.queue.empty() || !ch.pending.empty() || !ch.awaiting.empty() || ch.current != nullptr ||
                       ch.discarding)) {
        return true;
      }
    }
  }
  return false;
}

void Engine::finish_op_locked(Op& op, const std::string& failure) {
  if (failure.empty()) {
    op.mark_enqueued();
  } else {
    op.fail(failure);
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
    DPK_CUDA_CHECK(cudaSetDevice(device_));
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

// ---------------------------------------------------------------------------
// Teardown
// ---------------------------------------------------------------------------

void Engine::release_imports(Channel& ch, bool streams_idle) {
  // Peer resources mapped into this process. With copies possibly still in
  // flight (streams not idle) the mapping is leaked rather than pulled away.
  if (!streams_idle) return;
  for (int i = 0; i < kMaxSlots; ++i) {
    if (ch.peer_events[i] != nullptr) cudaEventDestroy(ch.peer_events[i]);
    ch.peer_events[i] = nullptr;
  }
  std::vector<char*> mapped;
  for (const PeerMapping& m : ch.opened) {
    if (std::find(mapped.begin(), mapped.end(), m.ptr) == mapped.end()) mapped.push_back(m.ptr);
  }
  for (char* ptr : mapped) cudaIpcCloseMemHandle(ptr);
  ch.opened.clear();
  if (ch.slots_ipc_opened) cudaIpcCloseMemHandle(ch.slots);
  ch.slots_ipc_opened = false;
  if (ch.host_registered) cudaHostUnregister(ch.slots);
  ch.host_registered = false;
  if (ch.ctl != nullptr && ch.ready) {
    (ch.outgoing ? ch.ctl->sender_detached : ch.ctl->receiver_detached).store(1, std::memory_order_release);
  }
}

void Engine::release_exports(Channel& ch, Clock::time_point deadline, bool streams_idle) {
  // Memory and events the peer may have opened: CUDA leaves it undefined to
  // free them while the peer still uses them, so wait (bounded) until the peer
  // has detached, has exited, or never attached.
  if (ch.ctl != nullptr && ch.ready) {
    CtlBlock& c = *ch.ctl;
    const bool peer_attached = ch.outgoing || c.sender_attached.load(std::memory_order_acquire) != 0;
    const int peer_pid = ch.outgoing ? c.receiver_pid : c.sender_pid.load();
    const auto& peer_detached = ch.outgoing ? c.receiver_detached : c.sender_detached;
    const auto poll_start = Clock::now();
    while (peer_attached && peer_detached.load(std::memory_order_acquire) == 0 && !pid_exited(peer_pid) &&
           Clock::now() < deadline) {
      backoff(Clock::now() - poll_start);
    }
  }
  if (streams_idle) {
    for (int i = 0; i < kMaxSlots; ++i) {
      if (ch.local_events[i] != nullptr) cudaEventDestroy(ch.local_events[i]);
      ch.local_events[i] = nullptr;
    }
    if (ch.slots_device_owned) cudaFree(ch.slots);
    ch.slots_device_owned = false;
  }
  if (ch.host_registered) cudaHostUnregister(ch.slots);
  ch.host_registered = false;
  if (ch.shm_base != nullptr) ::munmap(ch.shm_base, ch.shm_size);
  ch.shm_base = nullptr;
  ch.ctl = nullptr;
  if (ch.shm_linked) ::shm_unlink(ch.shm_name.c_str());
  ch.shm_linked = false;
}

void Engine::close(double timeout_s) {
  std::vector<std::shared_ptr<void>> drop;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
    fail_all_locked("rank " + std::to_string(rank_) + ": transport closed before the transfer completed");
    drop.swap(released_);
  }
  drop.clear();
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();

  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s < 0 ? 0.0 : timeout_s));
  int previous = -1;
  const bool have_device = cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess;
  // Let copies already on the comm streams finish (bounded) before unmapping
  // what they read or write.
  bool idle = have_device;
  const auto poll_start = Clock::now();
  for (cudaStream_t s : {send_stream_, recv_stream_}) {
    while (idle && s != nullptr) {
      const cudaError_t r = cudaStreamQuery(s);
      if (r == cudaSuccess) break;
      if (r != cudaErrorNotReady || Clock::now() >= deadline) {
        (void)cudaGetLastError();
        idle = false;
        break;
      }
      backoff(Clock::now() - poll_start);
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  // Imports first on every channel (this tells each peer it may free its
  // exports), then exports, so two ranks closing together never wait on each other.
  for (auto* map : {&outgoing_, &incoming_}) {
    for (auto& kv : *map) release_imports(kv.second, idle);
  }
  for (auto* map : {&outgoing_, &incoming_}) {
    for (auto& kv : *map) release_exports(kv.second, deadline, idle);
  }
  outgoing_.clear();
  incoming_.clear();
  if (idle) {
    if (send_stream_ != nullptr) cudaStreamDestroy(send_stream_);
    if (recv_stream_ != nullptr) cudaStreamDestroy(recv_stream_);
    send_stream_ = recv_stream_ = nullptr;
  }
  if (have_device && previous >= 0) cudaSetDevice(previous);
}

}  // namespace dualpipe::cuda
