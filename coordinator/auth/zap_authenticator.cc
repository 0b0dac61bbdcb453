#include "coordinator/auth/zap_authenticator.h"

#include <zmq.h>

#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "zmq.hpp"

namespace mlaserve {
namespace {

using Clock = std::chrono::steady_clock;

// RFC 27 request: version, request id, domain, address, routing id, mechanism, credentials...
constexpr size_t kRequestFrames = 6;

}  // namespace

absl::StatusOr<std::unique_ptr<ZapAuthenticator>> ZapAuthenticator::Start(
    zmq::context_t& ctx, const std::map<std::string, std::vector<AllowedCurveKey>>& domains,
    std::string log_prefix) {
  std::unique_ptr<ZapAuthenticator> a(new ZapAuthenticator());
  for (const auto& [domain, keys] : domains) {
    auto& set = a->allowed_[domain];
    for (const AllowedCurveKey& k : keys) {
      set.emplace(k.public_key, k.label);
    }
  }
  a->log_prefix_ = std::move(log_prefix);
  // The socket is made and bound here, so that a failure is reported before any CURVE socket
  // binds, then handed to the thread (a ZeroMQ socket may move between threads).
  auto sock = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::rep);
  sock->set(zmq::sockopt::linger, 0);
  try {
    sock->bind("inproc://zeromq.zap.01");
  } catch (const zmq::error_t& e) {
    return absl::InternalError(
        absl::StrCat("cannot bind the ZAP handler (inproc://zeromq.zap.01): ", e.what()));
  }
  ZapAuthenticator* self = a.get();
  a->thread_ = std::thread([self, s = std::move(sock)]() mutable {
    self->Serve(s.get());
    s.reset();
  });
  return a;
}

ZapAuthenticator::~ZapAuthenticator() {
  stop_.store(true);
  if (thread_.joinable()) {
    thread_.join();
  }
}

void ZapAuthenticator::Serve(void* socket) {
  auto& sock = *static_cast<zmq::socket_t*>(socket);
  std::map<std::string, Clock::time_point> last_logged;  // by key: one line a minute at most
  std::map<std::string, int64_t> unlogged;
  while (!stop_.load()) {
    zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
    try {
      if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) == 0) {
        continue;
      }
    } catch (const zmq::error_t&) {
      return;  // context terminated
    }
    std::vector<zmq::message_t> frames;
    try {
      do {
        zmq::message_t m;
        if (!sock.recv(m, zmq::recv_flags::dontwait)) {
          break;
        }
        frames.push_back(std::move(m));
      } while (sock.get(zmq::sockopt::rcvmore));
    } catch (const zmq::error_t&) {
      return;
    }
    if (frames.empty()) {
      continue;
    }
    // A REP socket must answer what it received; a malformed request is refused.
    std::string domain, address, mechanism, key;
    if (frames.size() >= kRequestFrames) {
      domain = frames[2].to_string();
      address = frames[3].to_string();
      mechanism = frames[5].to_string();
    }
    if (mechanism == "CURVE" && frames.size() > kRequestFrames && frames[6].size() == 32) {
      char z85[41];
      if (zmq_z85_encode(z85, static_cast<const uint8_t*>(frames[6].data()), 32) != nullptr) {
        key.assign(z85, 40);
      }
    }
    std::string status = "400", text = "client key not allowed", user;
    auto d = allowed_.find(domain);
    if (d != allowed_.end() && !key.empty()) {
      auto k = d->second.find(key);
      if (k != d->second.end()) {
        status = "200";
        text = "OK";
        user = k->second;
      }
    }
    if (status == "200") {
      accepted_.fetch_add(1);
    } else {
      refused_.fetch_add(1);
    }
    // One line per key a minute at most: peers that keep failing reconnect every 100 ms.
    const std::string who = key.empty() ? mechanism : key;
    if (last_logged.size() > 4096) {  // many keys (a scan): forget, and log them again
      last_logged.clear();
      unlogged.clear();
    }
    const auto now = Clock::now();
    auto it = last_logged.find(who);
    if (it == last_logged.end() || now - it->second > std::chrono::minutes(1)) {
      std::string line =
          absl::StrCat(log_prefix_, status == "200" ? ": accepted" : ": refused", " a ", mechanism,
                       " peer from ", address, " on the ", domain, " socket: ");
      if (status == "200") {
        absl::StrAppend(&line, user, " (", key, ")");
      } else {
        absl::StrAppend(&line, key.empty() ? std::string("no CURVE key")
                                           : absl::StrCat("public key ", key, " is not allowed"));
      }
      if (unlogged[who] > 0) {
        absl::StrAppend(&line, " (and ", unlogged[who], " more times)");
      }
      std::fprintf(stderr, "%s\n", line.c_str());
      last_logged[who] = now;
      unlogged[who] = 0;
    } else {
      ++unlogged[who];
    }
    try {
      sock.send(zmq::str_buffer("1.0"), zmq::send_flags::sndmore);
      sock.send(zmq::buffer(frames.size() > 1 ? frames[1].to_string() : std::string()),
                zmq::send_flags::sndmore);
      sock.send(zmq::buffer(status), zmq::send_flags::sndmore);
      sock.send(zmq::buffer(text), zmq::send_flags::sndmore);
      sock.send(zmq::buffer(user), zmq::send_flags::sndmore);
      sock.send(zmq::str_buffer(""), zmq::send_flags::none);
    } catch (const zmq::error_t&) {
      return;
    }
  }
}

}  // namespace mlaserve
