// Unit tests of a shared-memory channel's single-copy path (process_vm_readv) in one process (two threads).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "test_util.h"

namespace dualpipe::shm {
namespace {

using testing::expect_roundtrip;
using testing::LocalPair;
using testing::payload;
using testing::small_config;

ChannelConfig single_copy_config(bool enabled) {
  auto c = small_config(3, 4096);
  c.single_copy = enabled;
  c.single_copy_min_bytes = 16 * 1024;
  return c;
}

TEST(ShmSingleCopy, ProbeDecidesAndEitherSideCanDisable) {
  // Reading our own memory is always permitted, so the probe says yes unless a config says no.
  EXPECT_TRUE(LocalPair(single_copy_config(true)).tx->single_copy_active());
  EXPECT_FALSE(LocalPair(single_copy_config(false)).tx->single_copy_active());
  auto sender_off = single_copy_config(true);
  sender_off.single_copy = false;
  auto pair = LocalPair(single_copy_config(true));
  auto* h = static_cast<RingHeader*>(pair.segment->data());
  EXPECT_EQ(h->single_copy.load(), static_cast<std::uint32_t>(SingleCopy::kPermitted));
  // A receiver that is not allowed to (or does not want to) publishes "unavailable".
  auto seg = create_ring_segment(sender_off, 0, 1);
  seg->unlink();
  SendChannel tx(seg, 0, 1, single_copy_config(true));
  RecvChannel rx(seg, 1, 0, sender_off);
  EXPECT_EQ(static_cast<RingHeader*>(seg->data())->single_copy.load(),
            static_cast<std::uint32_t>(SingleCopy::kUnavailable));
  EXPECT_FALSE(tx.single_copy_active());
}

TEST(ShmSingleCopy, SizesAroundTheThresholdOnBothPaths) {
  for (bool enabled : {true, false}) {
    LocalPair p(single_copy_config(enabled));
    ASSERT_EQ(p.tx->single_copy_active(), enabled);
    std::uint32_t seed = 0;
    // 9 MiB + 5 crosses the 4 MiB read pieces twice.
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{16383}, std::size_t{16384}, std::size_t{16385},
                          std::size_t{3 * 16384 + 7}, (std::size_t{9} << 20) + 5}) {
      SCOPED_TRACE("single_copy=" + std::to_string(enabled) + " n=" + std::to_string(n));
      expect_roundtrip(p, n, static_cast<std::int64_t>(n % 7), ++seed);
    }
  }
}

TEST(ShmSingleCopy, SenderCompletesOnlyAfterTheReceiverRead) {
  LocalPair p(single_copy_config(true));
  const auto src = payload(100000, 11);
  auto s = p.tx->post(src.data(), src.size(), 2, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(s->query()) << "the sender's buffer is still needed until the receiver has read it";
  std::vector<unsigned char> dst(src.size());
  auto r = p.rx->post(dst.data(), dst.size(), 2, 0);
  ASSERT_TRUE(r->wait(10.0));
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(s->state(), Request::State::kDone) << s->error();
  EXPECT_EQ(s->bytes_done(), src.size());
  EXPECT_EQ(dst, src);
}

TEST(ShmSingleCopy, MixedPathsManyInFlightOutOfOrderWaits) {
  LocalPair p(single_copy_config(true));
  constexpr int kMessages = 24;
  std::vector<std::vector<unsigned char>> srcs, dsts;
  std::vector<std::shared_ptr<Request>> rs, ss;
  for (int k = 0; k < kMessages; ++k) {
    const std::size_t n = (k % 3 == 0) ? 100 + k : (k % 3 == 1) ? 16384 + 977 * k : 200000 + k;
    srcs.push_back(payload(n, 500 + k));
    dsts.emplace_back(n, 0);
  }
  for (int k = 0; k < kMessages; ++k) rs.push_back(p.rx->post(dsts[k].data(), dsts[k].size(), k % 4, 0));
  for (int k = 0; k < kMessages; ++k) ss.push_back(p.tx->post(srcs[k].data(), srcs[k].size(), k % 4, 0));
  for (int k = kMessages - 1; k >= 0; --k) ASSERT_TRUE(rs[k]->wait(20.0)) << k;
  for (int k = 0; k < kMessages; ++k) ASSERT_TRUE(ss[k]->wait(20.0)) << k;
  for (int k = 0; k < kMessages; ++k) {
    EXPECT_EQ(rs[k]->state(), Request::State::kDone) << rs[k]->error();
    EXPECT_EQ(dsts[k], srcs[k]) << "message " << k;
  }
}

TEST(ShmSingleCopy, StashedWhenAnotherTagWaits) {
  LocalPair p(single_copy_config(true));
  const auto big = payload(300000, 1), small = payload(50, 2);
  std::vector<unsigned char> big_dst(big.size()), small_dst(small.size());
  auto r_small = p.rx->post(small_dst.data(), small_dst.size(), 2, 0);  // its message comes second
  auto s_big = p.tx->post(big.data(), big.size(), 1, 0);
  auto s_small = p.tx->post(small.data(), small.size(), 2, 0);
  ASSERT_TRUE(r_small->wait(10.0));
  ASSERT_TRUE(s_big->wait(10.0)) << "the stash read must acknowledge the descriptor";
  EXPECT_EQ(p.rx->stashed(), 1u);
  auto r_big = p.rx->post(big_dst.data(), big_dst.size(), 1, 0);
  ASSERT_TRUE(r_big->wait(10.0));
  ASSERT_TRUE(s_small->wait(10.0));
  EXPECT_EQ(r_big->state(), Request::State::kDone) << r_big->error();
  EXPECT_EQ(big_dst, big);
  EXPECT_EQ(small_dst, small);
}

TEST(ShmSingleCopy, SizeMismatchFailsBothSidesWithoutWriting) {
  LocalPair p(single_copy_config(true));
  const auto src = payload(100000, 1);
  std::vector<unsigned char> dst(100004, 0xAB);
  auto s = p.tx->post(src.data(), src.size(), 5, 0, "the send");
  auto r = p.rx->post(dst.data(), dst.size(), 5, 0, "the recv");
  ASSERT_TRUE(r->wait(10.0));
  ASSERT_EQ(r->state(), Request::State::kFailed);
  EXPECT_NE(r->error().find("size mismatch"), std::string::npos) << r->error();
  EXPECT_NE(r->error().find("100000 B"), std::string::npos) << r->error();
  EXPECT_EQ(dst, std::vector<unsigned char>(100004, 0xAB)) << "a mismatched receive wrote into the buffer";
  // The sender was waiting for the read: it fails instead of completing.
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(s->state(), Request::State::kFailed);
  EXPECT_NE(s->error().find("receiver reported"), std::string::npos) << s->error();
}

TEST(ShmSingleCopy, DtypeMismatchNamesBothDtypes) {
  LocalPair p(single_copy_config(true));
  const auto src = payload(65536, 1);
  std::vector<unsigned char> dst(65536, 0);
  auto s = p.tx->post(src.data(), src.size(), 1, /*dtype=*/0);
  auto r = p.rx->post(dst.data(), dst.size(), 1, /*dtype=*/1);
  ASSERT_TRUE(r->wait(10.0));
  ASSERT_EQ(r->state(), Request::State::kFailed);
  EXPECT_NE(r->error().find("float32"), std::string::npos) << r->error();
  EXPECT_NE(r->error().find("float64"), std::string::npos) << r->error();
  EXPECT_EQ(dst, std::vector<unsigned char>(65536, 0));
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(s->state(), Request::State::kFailed);
}

TEST(ShmSingleCopy, SenderCloseBeforeTheReadFailsBothSides) {
  // A closed sender may free its buffer: a descriptor it published is never delivered as valid data.
  LocalPair p(single_copy_config(true));
  const auto src = payload(100000, 1);
  auto s = p.tx->post(src.data(), src.size(), 5, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  p.tx->close();
  ASSERT_TRUE(s->query());
  EXPECT_EQ(s->state(), Request::State::kFailed);
  std::vector<unsigned char> dst(src.size());
  auto r = p.rx->post(dst.data(), dst.size(), 5, 0);
  ASSERT_TRUE(r->wait(10.0));
  EXPECT_EQ(r->state(), Request::State::kFailed);
  EXPECT_NE(r->error().find("closed its end"), std::string::npos) << r->error();
}

TEST(ShmSingleCopy, ReceiverCloseFailsTheWaitingSender) {
  LocalPair p(single_copy_config(true));
  const auto src = payload(100000, 1);
  auto s = p.tx->post(src.data(), src.size(), 5, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  p.rx->close();
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(s->state(), Request::State::kFailed);
  EXPECT_NE(s->error().find("closed its end"), std::string::npos) << s->error();
}

}  // namespace
}  // namespace dualpipe::shm
