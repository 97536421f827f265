#include "shm_ring.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <new>
#include <stdexcept>
#include <string>

namespace dualpipe::shm {
namespace {

constexpr std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }
constexpr std::size_t header_bytes() { return round_up(sizeof(RingHeader), kCacheLine); }
std::size_t slot_stride(std::uint64_t slot_bytes) {
  return sizeof(SlotHeader) + round_up(static_cast<std::size_t>(slot_bytes), kCacheLine);
}

}  // namespace

std::size_t ring_segment_bytes(std::uint32_t num_slots, std::uint64_t slot_bytes) {
  return header_bytes() + static_cast<std::size_t>(num_slots) * slot_stride(slot_bytes);
}

RingView RingView::initialise(void* base, std::size_t bytes, std::uint32_t num_slots, std::uint64_t slot_bytes,
                              int src_rank, int dst_rank) {
  if (num_slots < 2) throw std::invalid_argument("ring needs num_slots >= 2 (double buffering), got " +
                                                 std::to_string(num_slots));
  if (slot_bytes < 64) throw std::invalid_argument("ring needs slot_bytes >= 64, got " + std::to_string(slot_bytes));
  if (bytes < ring_segment_bytes(num_slots, slot_bytes)) throw std::invalid_argument("ring segment too small");
  // The segment is fresh from ftruncate (zero-filled); construct the atomics in place.
  auto* h = new (base) RingHeader{};
  h->version = kRingVersion;
  h->num_slots = num_slots;
  h->slot_bytes = slot_bytes;
  h->segment_bytes = bytes;
  h->src_rank = src_rank;
  h->dst_rank = dst_rank;
  h->magic.store(kRingMagic, std::memory_order_release);
  return attach(base, bytes);
}

RingView RingView::attach(void* base, std::size_t bytes) {
  auto* h = static_cast<RingHeader*>(base);
  if (bytes < header_bytes() || h->magic.load(std::memory_order_acquire) != kRingMagic) {
    throw std::runtime_error("shared-memory segment is not an initialised dualpipe ring (bad magic)");
  }
  if (h->version != kRingVersion) {
    throw std::runtime_error("ring version " + std::to_string(h->version) + " != " + std::to_string(kRingVersion));
  }
  if (h->num_slots < 2 || bytes < ring_segment_bytes(h->num_slots, h->slot_bytes)) {
    throw std::runtime_error("ring header geometry does not fit its segment");
  }
  RingView v;
  v.header_ = h;
  v.slots_ = static_cast<unsigned char*>(base) + header_bytes();
  v.slot_stride_ = slot_stride(h->slot_bytes);
  return v;
}

SlotHeader* RingView::slot_header(std::uint64_t chunk) const {
  return reinterpret_cast<SlotHeader*>(slots_ + (chunk % header_->num_slots) * slot_stride_);
}

unsigned char* RingView::slot_data(std::uint64_t chunk) const {
  return slots_ + (chunk % header_->num_slots) * slot_stride_ + sizeof(SlotHeader);
}

void RingView::set_error(const std::string& text) const {
  std::uint32_t expected = 0;
  if (!header_->error.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return;
  const std::size_t n = std::min(text.size(), kErrorTextBytes - 1);
  std::memcpy(header_->error_text, text.data(), n);
  header_->error_text[n] = '\0';
  header_->error.store(2, std::memory_order_release);
  // Wake anyone sleeping on the ring so they see the error now.
  futex_wake_all(&header_->head);
  futex_wake_all(&header_->tail);
}

std::string RingView::error() const {
  const std::uint32_t e = header_->error.load(std::memory_order_acquire);
  if (e == 0) return "";
  if (e == 1) return "the ring was marked broken (error text still being written)";
  return std::string(header_->error_text);
}

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long timeout_ns) {
  timespec ts{};
  ts.tv_sec = timeout_ns / 1000000000L;
  ts.tv_nsec = timeout_ns % 1000000000L;
  // Not FUTEX_PRIVATE: the word may be shared with another process.
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, 0x7fffffff, nullptr, nullptr, 0);
}

}  // namespace dualpipe::shm
