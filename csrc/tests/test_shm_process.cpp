// Unit tests across processes (fork): rendezvous by segment name, both
// directions at once, a dead peer, segment cleanup.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/liveness.h"
#include "shm_engine.h"
#include "test_util.h"

namespace dualpipe::shm {
namespace {

using testing::payload;
using testing::small_config;

bool segment_listed(const std::string& name) {
  const std::string all = "\n" + list_segments() + "\n";
  return all.find("\n" + name.substr(1) + "\n") != std::string::npos;
}

//! Fork a child running `body` (which returns its exit code); returns the pid.
template <class Body>
pid_t fork_child(Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 1;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child failed: %s\n", e.what());
    }
    ::_exit(code);
  }
  return pid;
}

int wait_exit_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

//! Rank r of a two-process exchange: `rounds` messages each way, checked byte for byte.
int exchange(Engine& e, int peer, int rounds) {
  int bad = 0;
  for (int k = 0; k < rounds; ++k) {
    const std::size_t n = static_cast<std::size_t>((k * 7919) % 50000 + (k % 3 == 0 ? 0 : 1));
    const auto src = payload(n, static_cast<std::uint32_t>(1000 * e.rank() + k));
    std::vector<unsigned char> dst(n);
    auto r = e.recv(peer, dst.data(), n, k, 0);
    auto s = e.send(peer, src.data(), n, k, 0);
    if (!s->wait(30.0) || !r->wait(30.0) || r->state() != Request::State::kDone ||
        dst != payload(n, static_cast<std::uint32_t>(1000 * peer + k))) {
      ++bad;
    }
  }
  return bad;
}

//! Both rings between this process (rank 0) and a forked child (rank 1), set up as the
//! Python transport does it, with a pipe instead of a store: each side creates its
//! outgoing ring and passes the name; the receiver maps it and unlinks the name at
//! once. The child then runs `exchange` for `rounds` messages and exits 0 if all
//! matched. Returns the child's pid and the name of the child's ring to us (already
//! mapped by `parent`); `to_child` is the name of ours.
struct ForkedPeer {
  pid_t pid = -1;
  std::string to_parent;
};

ForkedPeer fork_exchanging_peer(Engine& parent, const ChannelConfig& cfg, const std::string& to_child, int rounds) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe() failed");
  ForkedPeer peer;
  peer.pid = fork_child([&] {
    ::close(fds[0]);
    Engine e(1, cfg);
    e.attach_recv_channel(0, to_child);
    const std::string to_parent = e.create_send_channel(0);
    const std::size_t len = to_parent.size();
    if (::write(fds[1], &len, sizeof len) != sizeof len) return 2;
    if (::write(fds[1], to_parent.data(), len) != static_cast<ssize_t>(len)) return 2;
    const int bad = exchange(e, 0, rounds);
    e.close();
    return bad == 0 ? 0 : 3;
  });
  ::close(fds[1]);
  std::size_t len = 0;
  const bool got_len = ::read(fds[0], &len, sizeof len) == static_cast<ssize_t>(sizeof len);
  peer.to_parent.assign(got_len ? len : 0, '\0');
  const bool got_name = got_len && ::read(fds[0], peer.to_parent.data(), len) == static_cast<ssize_t>(len);
  ::close(fds[0]);
  if (!got_name) throw std::runtime_error("the forked peer did not send its ring name");
  parent.attach_recv_channel(1, peer.to_parent);
  return peer;
}

TEST(ShmProcess, TwoForkedProcessesBothDirections) {
  const auto cfg = small_config(3, 4096);
  Engine parent(0, cfg);
  const std::string to_child = parent.create_send_channel(1);
  const ForkedPeer child = fork_exchanging_peer(parent, cfg, to_child, 60);
  const std::string& to_parent = child.to_parent;
  EXPECT_FALSE(segment_listed(to_parent)) << "the receiver unlinks the name once mapped";
  EXPECT_EQ(exchange(parent, 1, 60), 0);
  parent.unlink_send_segment(1);
  EXPECT_FALSE(segment_listed(to_child));
  EXPECT_EQ(wait_exit_code(child.pid), 0);
  parent.close();
}

TEST(ShmProcess, DeadSenderIsReportedByName) {
  const auto cfg = small_config(2, 256);
  auto seg = create_ring_segment(cfg, 5, 6);
  RecvChannel rx(seg, 6, 5, cfg);
  // The child attaches as the sender, publishes part of a 16 MiB message
  // (65536 chunks of 256 B), then is killed.
  constexpr std::size_t kBytes = 16u << 20;
  const pid_t child = fork_child([&] {
    SendChannel tx(seg, 5, 6, cfg);
    const std::vector<unsigned char> src(kBytes, 1);
    auto s = tx.post(src.data(), src.size(), 1, 0);
    while (s->bytes_done() < 4096) std::this_thread::yield();
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  std::vector<unsigned char> dst(kBytes);
  auto r = rx.post(dst.data(), dst.size(), 1, 0, "doomed");
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(r->wait(20.0)) << "a dead peer must not look like a silent one";
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 5.0);
  EXPECT_EQ(r->state(), Request::State::kFailed);
  const std::string err = r->error();
  EXPECT_NE(err.find("peer rank 5 (pid " + std::to_string(child) + ")"), std::string::npos) << err;
  EXPECT_NE(err.find("exited"), std::string::npos) << err;  // zombie until reaped below
  EXPECT_NE(err.find("doomed"), std::string::npos) << err;
  EXPECT_EQ(wait_exit_code(child), 128 + SIGKILL);
}

TEST(ShmProcess, DeadReceiverIsReportedToSender) {
  const auto cfg = small_config(2, 64);
  auto seg = create_ring_segment(cfg, 1, 2);
  SendChannel tx(seg, 1, 2, cfg);
  const pid_t child = fork_child([&] {
    RecvChannel rx(seg, 2, 1, cfg);  // attaches (pid in the header), never receives
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  EXPECT_EQ(wait_exit_code(child), 128 + SIGKILL);  // reaped: kill(pid, 0) now fails with ESRCH
  const auto src = payload(10000, 2);                // far more than the 2 x 64 B ring holds
  auto s = tx.post(src.data(), src.size(), 1, 0);
  ASSERT_TRUE(s->wait(20.0));
  EXPECT_EQ(s->state(), Request::State::kFailed);
  EXPECT_NE(s->error().find("peer rank 2 (pid " + std::to_string(child) + ") exited"), std::string::npos)
      << s->error();
}

//! Can this process read `pid`'s memory (what the receiver's attach-time probe asks)?
bool can_read_memory_of(pid_t pid, const void* addr_there) {
  std::uint64_t word = 0;
  iovec l{&word, sizeof word};
  iovec r{const_cast<void*>(addr_there), sizeof word};
  return ::process_vm_readv(pid, &l, 1, &r, 1, 0) == static_cast<ssize_t>(sizeof word);
}

TEST(ShmProcess, SingleCopyBetweenForkedProcesses) {
  // As TwoForkedProcessesBothDirections, with most messages above the single-copy threshold.
  auto cfg = small_config(3, 4096);
  cfg.single_copy_min_bytes = 4096;
  Engine parent(0, cfg);
  const std::string to_child = parent.create_send_channel(1);
  const ForkedPeer child = fork_exchanging_peer(parent, cfg, to_child, 40);
  // The child probed us when it attached; the ring to the child uses single copy iff such reads work here.
  const bool readable = can_read_memory_of(child.pid, &cfg);  // fork: same address in the child
  EXPECT_EQ(parent.single_copy_to(1), readable);
  EXPECT_EQ(exchange(parent, 1, 40), 0);
  EXPECT_EQ(wait_exit_code(child.pid), 0);
  parent.close();
}

TEST(ShmProcess, SenderDeadBeforeItsDescriptorIsReadIsReportedByName) {
  auto cfg = small_config(2, 256);
  cfg.single_copy_min_bytes = 4096;
  auto seg = create_ring_segment(cfg, 5, 6);
  auto* h = static_cast<RingHeader*>(seg->data());
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  constexpr std::size_t kBytes = 8u << 20;
  const pid_t child = fork_child([&] {
    SendChannel tx(seg, 5, 6, cfg);
    char c = 1;
    if (::write(ready[1], &c, 1) != 1 || ::read(go[0], &c, 1) != 1) return 2;  // the receiver probes us meanwhile
    const std::vector<unsigned char> src(kBytes, 1);
    auto s = tx.post(src.data(), src.size(), 1, 0);
    while (h->head.load() == 0) std::this_thread::yield();  // the descriptor is published
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  RecvChannel rx(seg, 6, 5, cfg);
  const bool single_copy = h->single_copy.load() == static_cast<std::uint32_t>(SingleCopy::kPermitted);
  EXPECT_EQ(single_copy, can_read_memory_of(child, h));
  ASSERT_EQ(::write(go[1], &c, 1), 1);
  EXPECT_EQ(wait_exit_code(child), 128 + SIGKILL);  // reaped before we read: the read itself must fail
  std::vector<unsigned char> dst(kBytes, 7);
  auto r = rx.post(dst.data(), dst.size(), 1, 0, "doomed");
  ASSERT_TRUE(r->wait(20.0)) << "a dead peer must not look like a silent one";
  EXPECT_EQ(r->state(), Request::State::kFailed);
  const std::string err = r->error();
  EXPECT_NE(err.find("peer rank 5 (pid " + std::to_string(child) + ")"), std::string::npos) << err;
  EXPECT_NE(err.find("exited"), std::string::npos) << err;
  EXPECT_NE(err.find("doomed"), std::string::npos) << err;
  if (single_copy) {
    EXPECT_NE(err.find("during a single-copy read"), std::string::npos) << err;
  }
  for (int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);
}

TEST(ShmProcess, DeadReceiverIsReportedToASingleCopySender) {
  auto cfg = small_config(2, 64);
  cfg.single_copy_min_bytes = 1024;
  auto seg = create_ring_segment(cfg, 1, 2);
  SendChannel tx(seg, 1, 2, cfg);
  const pid_t child = fork_child([&] {
    RecvChannel rx(seg, 2, 1, cfg);  // probes us, never receives
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  EXPECT_EQ(wait_exit_code(child), 128 + SIGKILL);
  // The child's probe ran (whatever it concluded, the sender must notice the death either way).
  EXPECT_NE(static_cast<RingHeader*>(seg->data())->single_copy.load(),
            static_cast<std::uint32_t>(SingleCopy::kUnknown));
  const auto src = payload(100000, 2);
  auto s = tx.post(src.data(), src.size(), 1, 0);
  ASSERT_TRUE(s->wait(20.0));
  EXPECT_EQ(s->state(), Request::State::kFailed);
  EXPECT_NE(s->error().find("peer rank 2 (pid " + std::to_string(child) + ") exited"), std::string::npos)
      << s->error();
}

TEST(ShmProcess, ProcessLiveness) {
  EXPECT_EQ(process_dead_reason(::getpid()), "");
  const pid_t child = fork_child([] { return 0; });
  // Not yet reaped: a zombie counts as dead.
  for (int i = 0; i < 200 && process_dead_reason(child).empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_NE(process_dead_reason(child), "");
  wait_exit_code(child);
  EXPECT_EQ(process_dead_reason(child), "exited");
  EXPECT_NE(process_dead_reason(0), "");
}

TEST(ShmProcess, SegmentsAreUnlinkedOnDestructionAndStaleOnesSwept) {
  std::string name;
  {
    auto seg = ShmSegment::create("unit", 4096);
    name = seg.name();
    EXPECT_TRUE(segment_listed(name));
  }
  EXPECT_FALSE(segment_listed(name)) << "the creator unlinks a name nobody unlinked";

  // A process killed before it could unlink leaves its segment behind; the sweep removes it.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = fork_child([&] {
    auto seg = ShmSegment::create("stale", 4096);
    const std::size_t len = seg.name().size();
    if (::write(fds[1], &len, sizeof len) != sizeof len) return 2;
    if (::write(fds[1], seg.name().data(), len) != static_cast<ssize_t>(len)) return 2;
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  ::close(fds[1]);
  std::size_t len = 0;
  ASSERT_EQ(::read(fds[0], &len, sizeof len), static_cast<ssize_t>(sizeof len));
  std::string stale(len, '\0');
  ASSERT_EQ(::read(fds[0], stale.data(), len), static_cast<ssize_t>(len));
  ::close(fds[0]);
  wait_exit_code(child);
  // (A concurrent test process's engine start may sweep it first: both are fine.)
  EXPECT_EQ(segment_creator_pid(stale), static_cast<int>(child));
  sweep_stale_segments();
  EXPECT_FALSE(segment_listed(stale));
}

//! Our segments (either process) still in /dev/shm.
std::vector<std::string> segments_of(pid_t a, pid_t b) {
  std::vector<std::string> out;
  const std::string all = list_segments();
  std::size_t start = 0;
  while (start < all.size()) {
    std::size_t end = all.find('\n', start);
    if (end == std::string::npos) end = all.size();
    const std::string n = all.substr(start, end - start);
    const int pid = segment_creator_pid(n);
    if (pid == static_cast<int>(a) || pid == static_cast<int>(b)) out.push_back(n);
    start = end + 1;
  }
  return out;
}

enum class KillAt { kAfterCreate, kAfterPublish, kAfterAttach, kMidTransfer };
constexpr std::size_t kMidTransferBytes = 32u << 20;

//! kill -9 of the peer at one phase of the rendezvous or of a transfer (as the
//! Python transport orders them): once the survivor has closed its engine,
//! nothing of either process is left in /dev/shm, without another engine start.
void kill_peer_at(KillAt phase) {
  auto cfg = small_config(3, 4096);
  cfg.single_copy = false;  // the message goes through the ring, so the kill lands mid-message
  auto parent = std::make_unique<Engine>(0, cfg);
  const std::string to_child = parent->create_send_channel(1);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = fork_child([&] {
    ::close(fds[0]);
    Engine e(1, cfg);
    const std::string to_parent = e.create_send_channel(0);
    if (phase == KillAt::kAfterCreate) ::raise(SIGKILL);
    const std::size_t len = to_parent.size();
    if (::write(fds[1], &len, sizeof len) != sizeof len) return 2;
    if (::write(fds[1], to_parent.data(), len) != static_cast<ssize_t>(len)) return 2;
    if (phase == KillAt::kAfterPublish) ::raise(SIGKILL);
    e.attach_recv_channel(0, to_child);
    if (phase == KillAt::kAfterAttach) ::raise(SIGKILL);
    // 32 MiB through a 12 KiB ring is thousands of hand-overs (tens of ms): the kill lands long before the
    // end even when this thread is descheduled for a while (with 1 MiB the parent sometimes had it all first)
    std::vector<unsigned char> big(kMidTransferBytes, 7);
    auto s = e.send(0, big.data(), big.size(), 1, 0);
    while (s->bytes_done() < 4096) std::this_thread::yield();
    ::raise(SIGKILL);  // mid-transfer: the ring holds part of the message
    return 0;
  });
  ::close(fds[1]);
  std::size_t len = 0;
  if (::read(fds[0], &len, sizeof len) == static_cast<ssize_t>(sizeof len)) {
    std::string name(len, '\0');
    if (::read(fds[0], name.data(), len) == static_cast<ssize_t>(len)) {
      try {
        parent->attach_recv_channel(1, name);
      } catch (const std::exception&) {
        // already swept: its creator is dead
      }
    }
  }
  ::close(fds[0]);
  if (phase == KillAt::kMidTransfer && parent->has_recv_channel(1)) {
    std::vector<unsigned char> dst(kMidTransferBytes);
    auto r = parent->recv(1, dst.data(), dst.size(), 1, 0);
    EXPECT_TRUE(r->wait(20.0)) << "a dead peer fails the receive promptly";
    EXPECT_EQ(r->state(), Request::State::kFailed);
  }
  EXPECT_EQ(wait_exit_code(child), 128 + SIGKILL);
  parent->close();
  parent.reset();
  const auto left = segments_of(::getpid(), child);
  EXPECT_TRUE(left.empty()) << left.size() << " segment(s) left, e.g. " << (left.empty() ? "" : left.front());
}

TEST(ShmCrash, PeerKilledAfterCreatingItsRing) { kill_peer_at(KillAt::kAfterCreate); }
TEST(ShmCrash, PeerKilledAfterPublishingItsRing) { kill_peer_at(KillAt::kAfterPublish); }
TEST(ShmCrash, PeerKilledAfterMappingOurRing) { kill_peer_at(KillAt::kAfterAttach); }
TEST(ShmCrash, PeerKilledMidTransfer) { kill_peer_at(KillAt::kMidTransfer); }

TEST(ShmProcess, ForkedChildClosingDoesNotDisturbParent) {
  testing::LocalPair p(small_config(2, 64));
  auto roundtrip = [&](std::uint32_t seed) {
    const auto src = payload(1000, seed);  // > slot: goes through both worker threads
    std::vector<unsigned char> dst(src.size());
    auto r = p.rx->post(dst.data(), dst.size(), 1, 0);
    auto s = p.tx->post(src.data(), src.size(), 1, 0);
    return s->wait(10.0) && r->wait(10.0) && r->state() == Request::State::kDone && dst == src;
  };
  ASSERT_TRUE(roundtrip(1));
  // A forked child (think DataLoader worker) inherits both channels; closing them there
  // must neither touch the parent's threads nor mark the parent's ring ends closed.
  const pid_t child = fork_child([&] {
    p.tx->close();
    p.rx->close();
    return 0;
  });
  EXPECT_EQ(wait_exit_code(child), 0);
  EXPECT_TRUE(roundtrip(2));
}

TEST(ShmEngine, TwoEnginesInOneProcess) {
  const auto cfg = small_config(2, 1024);
  Engine a(0, cfg), b(1, cfg);
  b.attach_recv_channel(0, a.create_send_channel(1));
  a.attach_recv_channel(1, b.create_send_channel(0));
  a.unlink_send_segment(1);
  b.unlink_send_segment(0);
  std::thread tb([&] { EXPECT_EQ(exchange(b, 0, 30), 0); });
  EXPECT_EQ(exchange(a, 1, 30), 0);
  tb.join();
  EXPECT_THROW(a.send(7, nullptr, 0, 0, 0), std::invalid_argument);
  EXPECT_THROW(a.create_send_channel(0), std::invalid_argument);
  EXPECT_THROW(b.attach_recv_channel(2, "/dpk-does-not-exist"), std::runtime_error);
  a.close();
  EXPECT_THROW(a.send(1, nullptr, 0, 0, 0), std::runtime_error);
}

}  // namespace
}  // namespace dualpipe::shm
