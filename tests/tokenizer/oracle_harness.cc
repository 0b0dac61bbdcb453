#include "tests/tokenizer/oracle_harness.h"

#include <sys/stat.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace mlaserve::testing {

std::string SourceDir() {
  const char* dir = std::getenv("MLASERVE_SOURCE_DIR");
  return dir ? dir : "../..";
}

std::string ScratchDir() {
  const char* build = std::getenv("MLASERVE_BINARY_DIR");
  std::string dir = std::string(build ? build : "/tmp") + "/tokenizer_oracle_io";
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::string MissingTool(const std::string& path, const std::string& how_to_get_it) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return "";
  return "oracle not available: " + path + " is missing; " + how_to_get_it;
}

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::strcmp(ci, "") != 0 && std::strcmp(ci, "false") != 0 &&
         std::strcmp(ci, "0") != 0;
}

int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    output->append(buffer.data(), n);
  const int status = ::pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadBinaryFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

void WriteBinaryFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

uint32_t RecordReader::U32() {
  if (pos_ + 4 > data_.size()) throw std::runtime_error("truncated record file");
  uint32_t v;
  std::memcpy(&v, data_.data() + pos_, 4);
  pos_ += 4;
  return v;
}

std::string RecordReader::Bytes() {
  const uint32_t len = U32();
  if (pos_ + len > data_.size()) throw std::runtime_error("truncated record file");
  std::string out = data_.substr(pos_, len);
  pos_ += len;
  return out;
}

std::vector<int32_t> RecordReader::Ids() {
  const uint32_t count = U32();
  if (pos_ + 4ull * count > data_.size()) throw std::runtime_error("truncated record file");
  std::vector<int32_t> ids(count);
  if (count > 0) std::memcpy(ids.data(), data_.data() + pos_, 4ull * count);  // data() may be null
  pos_ += 4ull * count;
  return ids;
}

void AppendBytesRecord(std::string_view bytes, std::string* out) {
  const uint32_t len = static_cast<uint32_t>(bytes.size());
  out->append(reinterpret_cast<const char*>(&len), 4);
  out->append(bytes);
}

void AppendIdsRecord(const std::vector<int32_t>& ids, std::string* out) {
  const uint32_t count = static_cast<uint32_t>(ids.size());
  out->append(reinterpret_cast<const char*>(&count), 4);
  out->append(reinterpret_cast<const char*>(ids.data()), 4 * ids.size());
}

std::string Quote(std::string_view arg) {
  std::string out = "'";
  for (const char c : arg) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out.push_back(c);
    }
  }
  return out + "'";
}

}  // namespace mlaserve::testing
