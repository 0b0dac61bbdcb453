// The ZAP handler (ZeroMQ RFC 27) of one ZeroMQ context: decides which CURVE peers its server
// sockets accept. Each CURVE server socket names a ZAP domain (ZMQ_ZAP_DOMAIN); a peer is
// accepted when the public key it proved it holds is in that domain's allow list, refused
// (status 400, which the peer sees as ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) otherwise.
//
// libzmq accepts every CURVE peer when no ZAP handler is bound, so the handler is bound before
// any CURVE socket binds and lives as long as the context's sockets do. NULL-mechanism sockets
// without a ZAP domain (the loopback worker socket) do not consult it.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/auth/curve_keys.h"

namespace zmq {
class context_t;
}  // namespace zmq

namespace mlaserve {

class ZapAuthenticator {
 public:
  // `domains`: ZAP domain -> the public keys allowed in it. Decisions are logged to stderr as
  // "`log_prefix`: accepted|refused ..." (once per key a minute at most).
  static absl::StatusOr<std::unique_ptr<ZapAuthenticator>> Start(
      zmq::context_t& ctx, const std::map<std::string, std::vector<AllowedCurveKey>>& domains,
      std::string log_prefix);
  // Stops the handler thread. Destroy it after the CURVE sockets are closed.
  ~ZapAuthenticator();

  int64_t accepted() const { return accepted_.load(); }
  int64_t refused() const { return refused_.load(); }

 private:
  ZapAuthenticator() = default;
  void Serve(void* socket);

  std::map<std::string, std::map<std::string, std::string>> allowed_;  // domain -> key -> label
  std::string log_prefix_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> accepted_{0}, refused_{0};
  std::thread thread_;
};

}  // namespace mlaserve
