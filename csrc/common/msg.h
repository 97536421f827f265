// Error and status messages without iostreams.
//
// Why not std::ostringstream: some toolchains (the GPU machine's /opt/gcc with
// Ubuntu's -Wl,-Bsymbolic-functions) link parts of libstdc++ into the
// extension itself. The copy's formatting code then looks up locale facets
// registered by the process's libstdc++ under different ids, and formatting a
// number dereferences a null facet (SIGSEGV on the first H200; the same
// mismatch broke std::random_device). std::to_string and snprintf carry no
// such shared state. tests/unit/test_csrc_includes.py keeps <sstream>, <iostream>,
// <fstream>, <random> and <locale> out of csrc/.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace dualpipe {

//! Msg() << "rank " << 3 << ": " << 2.5 << " s"; .str() is the text.
class Msg {
 public:
  Msg& operator<<(const std::string& s) { return text_ += s, *this; }
  Msg& operator<<(const char* s) { return text_ += (s != nullptr ? s : "(null)"), *this; }
  Msg& operator<<(char c) { return text_ += c, *this; }
  template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char>, int> = 0>
  Msg& operator<<(T v) {
    if constexpr (std::is_same_v<T, bool>) return text_ += (v ? "true" : "false"), *this;
    return text_ += std::to_string(v), *this;
  }
  template <class T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
  Msg& operator<<(T v) {
    return *this << static_cast<std::underlying_type_t<T>>(v);
  }
  Msg& operator<<(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);  // what an ostream prints by default
    return text_ += buf, *this;
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

}  // namespace dualpipe
