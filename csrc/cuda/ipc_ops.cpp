// CUDA IPC comm engine, host logic: the event pool made once and the ops a post hands back (waits, queries,
// poisoning on failure).  Construction, rendezvous and posting are in ipc_engine.cpp, the worker's progress in
// ipc_worker.cpp; every CUDA call goes through DeviceApi.  See ipc_engine.h for the protocol.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/msg.h"
#include "common/poll.h"
#include "cuda/ipc_engine.h"

namespace dualpipe::cuda {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// EventPool
// ---------------------------------------------------------------------------

EventPool::EventPool(std::shared_ptr<DeviceApi> api, std::size_t initial) : api_(std::move(api)) {
  free_.reserve(initial);
  for (std::size_t i = 0; i < initial; ++i) {
    Event e = nullptr;
    const Status r = api_->event_create(&e, false);
    if (r != kOk) {
      for (Event x : free_) api_->event_destroy(x);
      check(*api_, r, "cudaEventCreateWithFlags(pool)");
    }
    free_.push_back(e);
    ++created_;
  }
}

EventPool::~EventPool() {
  // Destroying an event whose record has not completed is allowed: the driver
  // releases it once the device reaches it.
  for (Event e : free_) api_->event_destroy(e);
}

Event EventPool::take() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      Event e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  Event e = nullptr;
  check(*api_, api_->event_create(&e, false), "cudaEventCreateWithFlags(pool)");
  std::lock_guard<std::mutex> lk(mu_);
  ++created_;
  return e;
}

void EventPool::give(Event e) {
  if (e == nullptr) return;
  std::lock_guard<std::mutex> lk(mu_);
  free_.push_back(e);
}

std::uint64_t EventPool::created() const {
  std::lock_guard<std::mutex> lk(mu_);
  return created_;
}

// ---------------------------------------------------------------------------
// Op
// ---------------------------------------------------------------------------

// The wait for "enqueued" spins up to kEnqueueSpinUs before it sleeps: in a
// burst the worker enqueues an op within microseconds, and a sleep/wake per
// op would cost the host more than the enqueue itself.
namespace {
constexpr double kEnqueueSpinUs = 50.0;
}  // namespace

Op::Op(std::shared_ptr<EventPool> pool, TransferInfo info, char* ptr)
    : pool_(std::move(pool)), api_(pool_->api()), request_(std::move(info), ptr, kEnqueueSpinUs), ptr_(ptr) {
  std::strncpy(dtype_, request_.info().dtype_name.c_str(), kDtypeNameLen - 1);
}

Op::~Op() {
  // Back to the pool: a later record re-arms the event, and a stream that
  // already waits on it is bound to the record it saw (CUDA's rule).
  pool_->give(ready_event_);
  pool_->give(done_event_);
}

bool Op::wait_enqueued(double timeout_s) {
  if (!request_.wait(timeout_s)) return false;
  if (request_.state() == Request::State::kFailed) throw std::runtime_error(request_.error());
  throw_if_poisoned();
  return true;
}

void Op::poison(const std::string& why) {
  std::lock_guard<std::mutex> lk(poison_mu_);
  if (poisoned_.load()) return;
  poison_ = why + " [" + dualpipe::describe(request_.info()) + "]";
  poisoned_.store(true);
}

void Op::throw_if_poisoned() const {
  if (!poisoned_.load()) return;
  std::lock_guard<std::mutex> lk(poison_mu_);
  throw std::runtime_error(poison_);
}

std::string Op::error() const {
  if (poisoned_.load()) {
    std::lock_guard<std::mutex> lk(poison_mu_);
    return poison_;
  }
  return request_.error();
}

bool Op::wait(double timeout_s) {
  const auto start = Clock::now();
  if (!wait_enqueued(timeout_s)) return false;
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const auto poll_start = Clock::now();
  while (!finished(api_, api_.event_query(done_event_), "cudaEventQuery(done_event)")) {
    throw_if_poisoned();
    if (timeout_s >= 0 && Clock::now() >= deadline) return false;
    poll_pause(Clock::now() - poll_start);
  }
  throw_if_poisoned();
  return true;
}

bool Op::query() {
  if (!request_.query()) return false;
  if (failed()) return true;
  return finished(api_, api_.event_query(done_event_), "cudaEventQuery(done_event)");
}

bool Op::wait_stream(Stream stream, double timeout_s) {
  if (!wait_enqueued(timeout_s)) return false;
  check(api_, api_.stream_wait_event(stream, done_event_), "cudaStreamWaitEvent(done_event)");
  return true;
}

std::string Op::describe() const {
  Msg os;
  os << dualpipe::describe(request_.info()) << ": " << chunks_enqueued_.load() << " chunk(s) enqueued, ";
  switch (request_.state()) {
    case Request::State::kPending: os << "waiting for the peer"; break;
    case Request::State::kFailed: os << "failed"; break;
    case Request::State::kDone: os << (zero_copy() ? "enqueued zero-copy" : "enqueued"); break;
  }
  return os.str();
}

}  // namespace dualpipe::cuda
