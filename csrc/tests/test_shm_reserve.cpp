// Unit tests of reserved ring slots (SendChannel::reserve / SlotReservation), one process, two threads.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "test_util.h"

namespace dualpipe::shm {
namespace {

using testing::LocalPair;
using testing::payload;
using testing::small_config;

//! Reserve a slot of src.size() bytes, write src into it, commit.
void send_reserved(SendChannel& tx, const std::vector<unsigned char>& src, std::int64_t tag, double wait_s = 5.0) {
  std::string why;
  auto r = tx.reserve(src.size(), tag, 0, "reserved", wait_s, &why);
  ASSERT_TRUE(r) << why;
  ASSERT_EQ(r->nbytes(), src.size());
  if (!src.empty()) std::memcpy(r->data(), src.data(), src.size());
  r->commit();
  EXPECT_FALSE(r->open());
}

std::vector<unsigned char> receive(RecvChannel& rx, std::size_t n, std::int64_t tag) {
  std::vector<unsigned char> dst(n, 0xEE);
  auto r = rx.post(dst.data(), n, tag, 0);
  EXPECT_TRUE(r->wait(10.0)) << r->timeout_message(10.0);
  EXPECT_EQ(r->state(), Request::State::kDone) << r->error();
  return dst;
}

TEST(ShmReserve, CommittedSlotIsDeliveredWithoutAnEngineCopy) {
  LocalPair p(small_config(3, 4096));
  for (std::size_t n : {0, 1, 63, 4096}) {
    const auto src = payload(n, static_cast<std::uint32_t>(n));
    send_reserved(*p.tx, src, 5);
    EXPECT_EQ(receive(*p.rx, n, 5), src) << n << " B";
  }
  const SendStats s = p.tx->stats();
  EXPECT_EQ(s.copied_bytes, 0u);
  EXPECT_EQ(s.copied_messages, 0u);
  EXPECT_EQ(s.reserved_bytes, 1u + 63u + 4096u);
  EXPECT_EQ(s.reserved_messages, 4u);
}

TEST(ShmReserve, RingWrapsWithReservedAndPostedMessagesInPostOrder) {
  LocalPair p(small_config(2, 256), 0, 1, 0xFFFFFFF0u);  // also crosses the 32-bit counter wrap
  for (std::uint32_t k = 0; k < 60; ++k) {
    const auto a = payload(200, k), b = payload(150, k + 1000);
    send_reserved(*p.tx, a, 1);
    auto s = p.tx->post(b.data(), b.size(), 1, 0);
    EXPECT_EQ(receive(*p.rx, a.size(), 1), a);
    EXPECT_EQ(receive(*p.rx, b.size(), 1), b);
    ASSERT_TRUE(s->wait(10.0));
  }
  EXPECT_EQ(p.tx->stats().copied_bytes, 60u * 150u);
}

TEST(ShmReserve, SendsPostedWhileReservedQueueBehindIt) {
  LocalPair p(small_config(4, 256));
  const auto a = payload(100, 1), b = payload(100, 2);
  std::string why;
  auto r = p.tx->reserve(a.size(), 7, 0, "held", 1.0, &why);
  ASSERT_TRUE(r) << why;
  auto s = p.tx->post(b.data(), b.size(), 7, 0);  // would go inline, but the token is taken
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(s->query());
  std::memcpy(r->data(), a.data(), a.size());
  r->commit();
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(receive(*p.rx, a.size(), 7), a);  // reserved first: first in the ring
  EXPECT_EQ(receive(*p.rx, b.size(), 7), b);
}

TEST(ShmReserve, AbortAndDestructorPublishNothing) {
  LocalPair p(small_config(2, 128));
  {
    auto r = p.tx->reserve(64, 3, 0, "aborted", 1.0);
    ASSERT_TRUE(r);
    std::memset(r->data(), 0xAB, 64);
    r->abort();
    r->abort();  // idempotent
    EXPECT_THROW(r->commit(), std::logic_error);
  }
  {
    auto r = p.tx->reserve(64, 3, 0, "dropped", 1.0);
    ASSERT_TRUE(r);
    std::memset(r->data(), 0xCD, 64);
  }  // destroyed open: aborted
  const auto src = payload(64, 9);
  auto s = p.tx->post(src.data(), src.size(), 3, 0);
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(receive(*p.rx, 64, 3), src);
  EXPECT_EQ(p.tx->stats().reserved_messages, 0u);
}

TEST(ShmReserve, LargerThanASlotIsRefused) {
  LocalPair p(small_config(2, 128), 2, 5);
  try {
    p.tx->reserve(129, 4, 0, "too big", 0.0);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 2 send to rank 5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("128 B"), std::string::npos) << msg;
  }
}

TEST(ShmReserve, FullRingTimesOutNamingTheTransferThenSucceeds) {
  LocalPair p(small_config(2, 64), 3, 4);
  const auto a = payload(64, 1), b = payload(64, 2), c = payload(64, 3);
  send_reserved(*p.tx, a, 1);
  send_reserved(*p.tx, b, 1);  // both slots full now; nobody drains
  std::string why;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(p.tx->reserve(64, 9, 0, "third", 0.1, &why));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.09);
  EXPECT_LT(took, 2.0);
  EXPECT_NE(why.find("rank 3 send to rank 4"), std::string::npos) << why;
  EXPECT_NE(why.find("tag 9"), std::string::npos) << why;
  EXPECT_NE(why.find("third"), std::string::npos) << why;
  EXPECT_NE(why.find("free ring slot"), std::string::npos) << why;
  EXPECT_FALSE(p.tx->reserve(64, 9, 0, "try", 0.0));  // a try never waits
  std::thread drain([&] { EXPECT_EQ(receive(*p.rx, 64, 1), a); });
  send_reserved(*p.tx, c, 1, 10.0);  // waits for the receiver to free a slot
  drain.join();
  EXPECT_EQ(receive(*p.rx, 64, 1), b);
  EXPECT_EQ(receive(*p.rx, 64, 1), c);
}

TEST(ShmReserve, WaitsForQueuedSendsAheadOfIt) {
  auto cfg = small_config(2, 256);
  cfg.single_copy = false;
  LocalPair p(cfg);
  const auto big = payload(5000, 4);  // needs the receiver: stays queued / running
  auto s = p.tx->post(big.data(), big.size(), 1, 0);
  std::string why;
  EXPECT_FALSE(p.tx->reserve(10, 2, 0, "behind", 0.05, &why));
  EXPECT_NE(why.find("queued ahead"), std::string::npos) << why;
  std::thread drain([&] { EXPECT_EQ(receive(*p.rx, big.size(), 1), big); });
  const auto small = payload(10, 5);
  send_reserved(*p.tx, small, 2, 10.0);
  drain.join();
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(receive(*p.rx, 10, 2), small);
}

TEST(ShmReserve, CommitAfterCloseOrBreakFailsAndPublishesNothing) {
  {
    LocalPair p(small_config(2, 64));
    auto r = p.tx->reserve(8, 1, 0, "closing", 1.0);
    ASSERT_TRUE(r);
    p.tx->close();
    try {
      r->commit();
      FAIL() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("closed"), std::string::npos) << e.what();
    }
    EXPECT_THROW(p.tx->reserve(8, 1, 0, "after close", 0.0), std::runtime_error);
    EXPECT_EQ(p.tx->stats().reserved_messages, 0u);
  }
  {
    LocalPair p(small_config(2, 64));
    auto r = p.tx->reserve(8, 1, 0, "breaking", 1.0);
    ASSERT_TRUE(r);
    RingView::attach(p.segment->data(), p.segment->size()).set_error("test broke the ring");
    try {
      r->commit();
      FAIL() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("test broke the ring"), std::string::npos) << e.what();
    }
    EXPECT_EQ(static_cast<RingHeader*>(p.segment->data())->head.load(), 0u);
  }
}

TEST(ShmReserve, ConcurrentReserversAndPostersKeepPerTagOrder) {
  LocalPair p(small_config(3, 512));
  constexpr int kN = 200;
  std::thread reserver([&] {
    for (int k = 0; k < kN; ++k) {
      const auto src = payload(100 + k % 300, static_cast<std::uint32_t>(k));
      for (;;) {  // a try: on a busy channel, try again (what a caller falling back would post instead)
        auto r = p.tx->reserve(src.size(), 1, 0, "r", 0.0);
        if (!r) continue;
        std::memcpy(r->data(), src.data(), src.size());
        r->commit();
        break;
      }
    }
  });
  std::thread poster([&] {
    for (int k = 0; k < kN; ++k) {
      const auto src = payload(50 + k % 700, static_cast<std::uint32_t>(k + 7777));
      auto s = p.tx->post(src.data(), src.size(), 2, 0);
      ASSERT_TRUE(s->wait(10.0)) << s->timeout_message(10.0);
    }
  });
  std::thread other_tag([&] {
    for (int k = 0; k < kN; ++k) {
      EXPECT_EQ(receive(*p.rx, 50 + k % 700, 2), payload(50 + k % 700, static_cast<std::uint32_t>(k + 7777)));
    }
  });
  for (int k = 0; k < kN; ++k) {
    EXPECT_EQ(receive(*p.rx, 100 + k % 300, 1), payload(100 + k % 300, static_cast<std::uint32_t>(k)));
  }
  reserver.join();
  poster.join();
  other_tag.join();
  EXPECT_EQ(p.tx->stats().reserved_messages, static_cast<std::uint64_t>(kN));
}

}  // namespace
}  // namespace dualpipe::shm
