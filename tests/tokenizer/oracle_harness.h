// Running the independent reference implementations (Node, Debian's Python) from GoogleTest, and
// the record files exchanged with them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mlaserve::testing {

// Source and build folders (CTest sets MLASERVE_SOURCE_DIR / MLASERVE_BINARY_DIR).
std::string SourceDir();
std::string ScratchDir();  // a folder for oracle input/output files, created on demand

// Why an oracle tool is unusable, or empty when `path` (file or folder) exists.
std::string MissingTool(const std::string& path, const std::string& how_to_get_it);

// Under CI (env CI=true) a missing oracle is a failure; elsewhere the test is skipped.
bool InCi();

// Runs a shell command; returns its exit status and appends stderr+stdout to `output`.
int RunCommand(const std::string& command, std::string* output);

std::string ReadBinaryFile(const std::string& path);
void WriteBinaryFile(const std::string& path, std::string_view bytes);

// Sequential reader of little-endian uint32-length-prefixed records.
class RecordReader {
 public:
  explicit RecordReader(std::string data) : data_(std::move(data)) {}
  bool done() const { return pos_ >= data_.size(); }
  std::string Bytes();         // uint32 length + bytes
  std::vector<int32_t> Ids();  // uint32 count + int32 ids
 private:
  uint32_t U32();
  std::string data_;
  size_t pos_ = 0;
};

void AppendBytesRecord(std::string_view bytes, std::string* out);
void AppendIdsRecord(const std::vector<int32_t>& ids, std::string* out);

// Shell-quotes one argument.
std::string Quote(std::string_view arg);

}  // namespace mlaserve::testing

// Inside a test: fails under CI (env CI=true) when an oracle tool is missing, skips elsewhere.
// `missing` is empty when everything is there, else what to install. Expects testing::InCi
// to be visible (a using-declaration in the test file).
#define REQUIRE_ORACLE(missing)                   \
  do {                                            \
    const std::string why = (missing);            \
    if (!why.empty()) {                           \
      if (InCi()) FAIL() << why;                  \
      GTEST_SKIP() << why << " (fails under CI)"; \
    }                                             \
  } while (0)
