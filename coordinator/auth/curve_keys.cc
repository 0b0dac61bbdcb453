#include "coordinator/auth/curve_keys.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace mlaserve {
namespace {

constexpr size_t kZ85KeyChars = 40;  // 32 bytes as Z85

enum class FileKind { kSecret, kTrusted };

std::string Mode(mode_t m) { return absl::StrFormat("%04o", m & 07777); }

// Reads a whole key file after checking, on the opened file itself, that it is a regular file
// with permissions fit for its kind.
absl::StatusOr<std::string> ReadKeyFile(const std::string& path, FileKind kind) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open key file ", path, ": ", strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("key file ", path, " is not a regular file"));
  }
  if (kind == FileKind::kSecret && (st.st_mode & 077) != 0) {
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "key file ", path, " has mode ", Mode(st.st_mode),
        ": it holds a secret key, so only its owner may read it (chmod 600 ", path, ")"));
  }
  if (kind == FileKind::kTrusted && (st.st_mode & 022) != 0) {
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "key file ", path, " has mode ", Mode(st.st_mode),
        ": group or others may write it, and whoever can change it decides whom to trust "
        "(chmod 644 ",
        path, ")"));
  }
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return absl::UnavailableError(
          absl::StrCat("cannot read key file ", path, ": ", strerror(err)));
    }
    if (n == 0) {
      break;
    }
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (1 << 20)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat("key file ", path, " is over 1 MiB"));
    }
  }
  ::close(fd);
  return text;
}

struct KeyLine {
  std::string field;  // public-key | secret-key
  std::string key;
  std::string label;  // the comment line just above, without '#'
  int line = 0;
};

bool ValidZ85Key(const std::string& key) {
  if (key.size() != kZ85KeyChars) {
    return false;
  }
  uint8_t bytes[32];
  return zmq_z85_decode(bytes, key.c_str()) != nullptr;
}

absl::StatusOr<std::vector<KeyLine>> ParseKeyLines(const std::string& path,
                                                   const std::string& text) {
  std::vector<KeyLine> out;
  std::string comment;
  int n = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++n;
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty()) {
      comment.clear();
      continue;
    }
    if (absl::ConsumePrefix(&line, "#")) {
      comment = std::string(absl::StripAsciiWhitespace(line));
      continue;
    }
    std::vector<std::string> parts =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (parts.size() != 2 || (parts[0] != "public-key" && parts[0] != "secret-key")) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", n, ": expected `public-key KEY` or `secret-key KEY` (40 Z85 characters)"));
    }
    if (!ValidZ85Key(parts[1])) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", parts[0],
                                                     " is not a 40-character Z85 key (found ",
                                                     parts[1].size(), " characters)"));
    }
    out.push_back({parts[0], parts[1], comment, n});
    comment.clear();
  }
  return out;
}

absl::Status WriteNewFile(const std::string& path, const std::string& text, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) {
    if (errno == EEXIST) {
      return absl::AlreadyExistsError(
          absl::StrCat(path, " exists: not overwritten (remove it first to make a new key)"));
    }
    return absl::UnavailableError(absl::StrCat("cannot create ", path, ": ", strerror(errno)));
  }
  // The umask may have narrowed the mode; it cannot have widened it. Set it exactly.
  bool ok = ::fchmod(fd, mode) == 0;
  size_t done = 0;
  while (ok && done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    ok = n > 0;
    if (ok) {
      done += static_cast<size_t>(n);
    }
  }
  ok = ::fsync(fd) == 0 && ok;
  const int err = errno;
  ok = ::close(fd) == 0 && ok;
  if (!ok) {
    ::unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCurveSupport() {
  if (zmq_has("curve") != 0) {
    return absl::OkStatus();
  }
  int major = 0, minor = 0, patch = 0;
  zmq_version(&major, &minor, &patch);
  return absl::FailedPreconditionError(absl::StrCat(
      "this libzmq (", major, ".", minor, ".", patch,
      ") was built without CURVE support (libsodium): CURVE keys cannot be used; install a "
      "libzmq built with libsodium (Debian's libzmq5 is)"));
}

absl::StatusOr<CurveKeyPair> GenerateCurveKeyPair() {
  if (auto s = CheckCurveSupport(); !s.ok()) {
    return s;
  }
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) {
    return absl::InternalError(absl::StrCat("zmq_curve_keypair failed: ", zmq_strerror(errno)));
  }
  return CurveKeyPair{std::string(pub, kZ85KeyChars), std::string(sec, kZ85KeyChars)};
}

absl::StatusOr<CurveKeyPair> LoadCurveKeyPair(const std::string& path) {
  if (auto s = CheckCurveSupport(); !s.ok()) {
    return s;
  }
  auto text = ReadKeyFile(path, FileKind::kSecret);
  if (!text.ok()) {
    return text.status();
  }
  auto lines = ParseKeyLines(path, *text);
  if (!lines.ok()) {
    return lines.status();
  }
  CurveKeyPair pair;
  for (const KeyLine& l : *lines) {
    std::string& slot = l.field == "public-key" ? pair.public_key : pair.secret_key;
    if (!slot.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", l.line, ": a second ", l.field,
                                                     " (a key-pair file holds one pair)"));
    }
    slot = l.key;
  }
  if (pair.public_key.empty() || pair.secret_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     " is not a key-pair file: it needs a public-key and a secret-key line "
                     "(mlaserve-cli keygen PREFIX writes PREFIX.key)"));
  }
  char derived[41];
  if (zmq_curve_public(derived, pair.secret_key.c_str()) != 0 ||
      pair.public_key != std::string(derived, kZ85KeyChars)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": its public-key is not the public key of its secret-key"));
  }
  return pair;
}

absl::StatusOr<std::string> LoadCurvePublicKey(const std::string& path) {
  if (auto s = CheckCurveSupport(); !s.ok()) {
    return s;
  }
  auto text = ReadKeyFile(path, FileKind::kTrusted);
  if (!text.ok()) {
    return text.status();
  }
  auto lines = ParseKeyLines(path, *text);
  if (!lines.ok()) {
    return lines.status();
  }
  std::string key;
  for (const KeyLine& l : *lines) {
    if (l.field == "secret-key") {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", l.line, ": holds a secret key; give the peer's public-key file (.pub)"));
    }
    if (!key.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", l.line, ": a second public-key (a public-key file holds one)"));
    }
    key = l.key;
  }
  if (key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds no public-key line"));
  }
  return key;
}

absl::StatusOr<std::vector<AllowedCurveKey>> LoadAllowedCurveKeys(const std::string& path) {
  if (auto s = CheckCurveSupport(); !s.ok()) {
    return s;
  }
  auto text = ReadKeyFile(path, FileKind::kTrusted);
  if (!text.ok()) {
    return text.status();
  }
  auto lines = ParseKeyLines(path, *text);
  if (!lines.ok()) {
    return lines.status();
  }
  std::vector<AllowedCurveKey> out;
  std::set<std::string> seen;
  for (const KeyLine& l : *lines) {
    if (l.field == "secret-key") {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", l.line,
          ": holds a secret key; list the clients' public-key files (.pub), not their .key files"));
    }
    if (!seen.insert(l.key).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", l.line, ": key listed twice"));
    }
    out.push_back({l.key, l.label.empty() ? absl::StrCat(path, ":", l.line) : l.label});
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " names no client: it needs a public-key line per client"));
  }
  return out;
}

absl::Status WriteCurveKeyFiles(const std::string& prefix, const CurveKeyPair& pair,
                                const std::string& label) {
  if (!ValidZ85Key(pair.public_key) || !ValidZ85Key(pair.secret_key)) {
    return absl::InvalidArgumentError("not a Z85 key pair");
  }
  const std::string key_path = prefix + ".key", pub_path = prefix + ".pub";
  // Both names are checked first so that a refusal leaves nothing behind.
  for (const std::string& p : {key_path, pub_path}) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0) {
      return absl::AlreadyExistsError(
          absl::StrCat(p, " exists: not overwritten (remove it first to make a new key)"));
    }
  }
  // The comment line just above a key is its label (LoadAllowedCurveKeys).
  if (auto s = WriteNewFile(key_path,
                            absl::StrCat("# mlaserve CURVE key pair (ZeroMQ Z85). Secret: keep it "
                                         "at mode 0600.\n# ",
                                         label, "\npublic-key ", pair.public_key, "\nsecret-key ",
                                         pair.secret_key, "\n"),
                            0600);
      !s.ok()) {
    return s;
  }
  if (auto s = WriteNewFile(pub_path,
                            absl::StrCat("# mlaserve CURVE public key (ZeroMQ Z85)\n# ", label,
                                         "\npublic-key ", pair.public_key, "\n"),
                            0644);
      !s.ok()) {
    ::unlink(key_path.c_str());
    return s;
  }
  return absl::OkStatus();
}

bool IsLoopbackEndpoint(const std::string& endpoint) {
  absl::string_view e = endpoint;
  if (absl::StartsWith(e, "ipc://") || absl::StartsWith(e, "inproc://")) {
    return true;
  }
  if (!absl::ConsumePrefix(&e, "tcp://")) {
    return false;
  }
  // tcp://HOST:PORT, tcp://[V6]:PORT; a `;` introduces a source address on connect.
  e = e.substr(0, e.find(';'));
  absl::string_view host;
  if (absl::ConsumePrefix(&e, "[")) {
    host = e.substr(0, e.find(']'));
  } else {
    const size_t colon = e.rfind(':');
    host = colon == absl::string_view::npos ? e : e.substr(0, colon);
  }
  const std::string h = absl::AsciiStrToLower(host);
  if (h == "localhost" || h == "lo") {
    return true;
  }
  in_addr v4{};
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  return ::inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

}  // namespace mlaserve
