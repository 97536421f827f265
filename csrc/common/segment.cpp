#include "common/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <utility>

#include "common/errors.h"
#include "common/liveness.h"

namespace dualpipe {
namespace {

// 64 random bits from the kernel (getrandom), mixed with the clock and the pid
// should it fail. Not std::random_device: in an extension loaded next to a
// torch built with an older libstdc++, its out-of-line half can bind to that
// copy, whose object layout differs from the header's; on the first H200 the
// inline call then jumped through a null pointer (SIGSEGV in create_incoming).
std::string random_hex() {
  std::uint64_t bits = 0;
  if (::getrandom(&bits, sizeof bits, 0) != static_cast<ssize_t>(sizeof bits)) {
    static std::atomic<std::uint64_t> counter{0};
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    bits = static_cast<std::uint64_t>(ts.tv_nsec) ^ (static_cast<std::uint64_t>(ts.tv_sec) << 30) ^
           (static_cast<std::uint64_t>(::getpid()) << 40) ^ (counter.fetch_add(1) * 0x9E3779B97F4A7C15ull);
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(bits));
  return out;
}

void* map_fd(int fd, std::size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw std::runtime_error(errno_message("mmap", name));
  return p;
}

}  // namespace

ShmSegment ShmSegment::create(const std::string& label, std::size_t bytes) {
  if (bytes == 0) throw std::invalid_argument("shared-memory segment size must be > 0");
  ShmSegment seg;
  seg.name_ = "/" + std::string(kSegmentPrefix) + std::to_string(::getpid()) + "-" + random_hex() + "-" + label;
  const int fd = ::shm_open(seg.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_message("shm_open(create)", seg.name_));
  seg.creator_ = true;  // from here on the destructor unlinks the name
  const int fr = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (fr != 0) {
    errno = fr;
    const std::string msg = errno_message("posix_fallocate", seg.name_ + ", " + std::to_string(bytes) + " B");
    ::close(fd);
    throw std::runtime_error(msg);  // seg's destructor unlinks
  }
  try {
    seg.data_ = map_fd(fd, bytes, seg.name_);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  seg.size_ = bytes;
  return seg;
}

ShmSegment ShmSegment::create_anonymous(const std::string& label, std::size_t bytes) {
  if (bytes == 0) throw std::invalid_argument("shared-memory segment size must be > 0");
  const std::string what = std::string(kSegmentPrefix) + label;
  const int fd = ::memfd_create(what.c_str(), MFD_CLOEXEC);
  if (fd < 0) throw std::runtime_error(errno_message("memfd_create", what));
  const int fr = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (fr != 0) {
    errno = fr;
    const std::string msg = errno_message("posix_fallocate", what + ", " + std::to_string(bytes) + " B");
    ::close(fd);
    throw std::runtime_error(msg);
  }
  ShmSegment seg;
  seg.fd_ = fd;  // from here on the destructor closes it
  seg.creator_ = true;
  seg.name_ = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(fd);
  seg.data_ = map_fd(fd, bytes, what);
  seg.size_ = bytes;
  return seg;
}

bool anonymous_segments_enabled() {
  const char* v = std::getenv("DUALPIPE_KERNELS_SHM_NAMED");
  return v == nullptr || std::strcmp(v, "1") != 0;
}

ShmSegment ShmSegment::open(const std::string& name) {
  ShmSegment seg;
  seg.name_ = name;
  const bool by_proc = name.compare(0, 6, "/proc/") == 0;
  const int fd = by_proc ? ::open(name.c_str(), O_RDWR | O_CLOEXEC) : ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    std::string msg = errno_message(by_proc ? "open(anonymous segment)" : "shm_open(open)", name);
    if (by_proc) msg += " (the peer's /proc entry must be readable; DUALPIPE_KERNELS_SHM_NAMED=1 uses /dev/shm names)";
    throw std::runtime_error(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    const std::string msg = errno_message("fstat", name);
    ::close(fd);
    throw std::runtime_error(msg);
  }
  try {
    seg.data_ = map_fd(fd, static_cast<std::size_t>(st.st_size), name);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  seg.size_ = static_cast<std::size_t>(st.st_size);
  return seg;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = other.data_;
    size_ = other.size_;
    creator_ = other.creator_;
    unlinked_ = other.unlinked_;
    fd_ = other.fd_;
    other.fd_ = -1;
    other.data_ = nullptr;
    other.size_ = 0;
    other.creator_ = false;
    other.unlinked_ = true;
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::unlink() {
  if (unlinked_ || name_.empty()) return;
  unlinked_ = true;
  if (name_.compare(0, 6, "/proc/") == 0) {  // anonymous: no name; the creator lets go of its descriptor
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    return;
  }
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    throw std::runtime_error(errno_message("shm_unlink", name_));
  }
}

void ShmSegment::release() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
    unlinked_ = true;
  }
  if (creator_ && !unlinked_ && !name_.empty()) ::shm_unlink(name_.c_str());
  unlinked_ = true;
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

int segment_creator_pid(const std::string& name) {
  const std::string n = !name.empty() && name[0] == '/' ? name.substr(1) : name;
  for (const char* prefix : {kSegmentPrefix, kLegacyCudaPrefix}) {
    const std::size_t plen = std::strlen(prefix);
    if (n.compare(0, plen, prefix) != 0) continue;
    const int pid = std::atoi(n.c_str() + plen);
    return pid > 0 ? pid : -1;
  }
  return -1;
}

int sweep_stale_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (dirent* e = ::readdir(dir)) {
    const std::string n = e->d_name;
    const int pid = segment_creator_pid(n);
    if (pid <= 0 || process_dead_reason(pid).empty()) continue;
    if (::shm_unlink(("/" + n).c_str()) == 0) ++removed;
  }
  ::closedir(dir);
  return removed;
}

std::string list_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return "";
  std::string out;
  while (dirent* e = ::readdir(dir)) {
    const std::string n = e->d_name;
    if (segment_creator_pid(n) <= 0) continue;
    if (!out.empty()) out += "\n";
    out += n;
  }
  ::closedir(dir);
  return out;
}

}  // namespace dualpipe
