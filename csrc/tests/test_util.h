// Helpers of the C++ unit tests: deterministic payloads, an in-process channel pair.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "shm_channel.h"

namespace dualpipe::shm::testing {

//! Bytes that depend on (seed, index), so any misplaced chunk shows.
inline std::vector<unsigned char> payload(std::size_t n, std::uint32_t seed) {
  std::vector<unsigned char> v(n);
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

inline ChannelConfig small_config(std::uint32_t slots, std::uint64_t slot_bytes) {
  ChannelConfig c;
  c.num_slots = slots;
  c.slot_bytes = slot_bytes;
  c.spin_us = 20.0;
  c.liveness_interval_s = 0.02;
  c.dtype_names = {"float32", "float64", "float16"};
  return c;
}

//! Sender and receiver of one ring in this process, sharing one mapping (so
//! ThreadSanitizer sees both sides of every atomic).
struct LocalPair {
  std::shared_ptr<ShmSegment> segment;
  std::unique_ptr<SendChannel> tx;
  std::shared_ptr<RecvChannel> rx;  // shared: a waiting thread's poll hook holds it weakly

  //! `start` presets both ring counters (e.g. just below 2^32 to test their wraparound).
  explicit LocalPair(const ChannelConfig& cfg, int src = 0, int dst = 1, std::uint32_t start = 0) {
    segment = create_ring_segment(cfg, src, dst);
    segment->unlink();
    auto* h = static_cast<RingHeader*>(segment->data());
    h->head.store(start);
    h->tail.store(start);
    tx = std::make_unique<SendChannel>(segment, src, dst, cfg);
    rx = std::make_shared<RecvChannel>(segment, dst, src, cfg);
  }
};

//! One message of `n` bytes through `p` (sent after its receive is posted), checked byte for byte.
inline void expect_roundtrip(LocalPair& p, std::size_t n, std::int64_t tag, std::uint32_t seed) {
  const auto src = payload(n, seed);
  std::vector<unsigned char> dst(n, 0xEE);
  auto r = p.rx->post(dst.data(), n, tag, 0);
  auto s = p.tx->post(src.data(), n, tag, 0);
  ASSERT_TRUE(s->wait(10.0)) << s->timeout_message(10.0);
  ASSERT_TRUE(r->wait(10.0)) << r->timeout_message(10.0);
  ASSERT_EQ(s->state(), Request::State::kDone) << s->error();
  ASSERT_EQ(r->state(), Request::State::kDone) << r->error();
  EXPECT_EQ(dst, src) << "payload of " << n << " B differs";
  EXPECT_EQ(r->bytes_done(), n);
}

}  // namespace dualpipe::shm::testing
