// CURVE key files: the key pairs and public keys that authenticate ZeroMQ peers (the
// coordinator's client socket, its worker socket) and encrypt their traffic.
//
// Format (text, one key a line, '#' starts a comment line, blank lines ignored):
//
//   # mlaserve CURVE key pair (ZeroMQ Z85). Secret: keep it at mode 0600.
//   # alice                                         <- the key's label (the comment line above)
//   public-key rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7
//   secret-key JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6
//
// Each key is 40 characters of Z85 (ZeroMQ's text encoding of a 32-byte Curve25519 key, as
// zmq_z85_encode writes it).
// - A key-pair file (`PREFIX.key`) holds one public-key and one secret-key line; the public key
//   must be the secret key's. It is secret: it is refused unless only its owner may read it
//   (mode 0600 or 0400).
// - A public-key file (`PREFIX.pub`) holds one public-key line.
// - An allowed-clients file holds one public-key line per client (concatenated .pub files:
//   `cat alice.pub bob.pub > allowed_clients`); the comment line above a key names it in logs.
// (`mlaserve-cli keygen PREFIX` writes PREFIX.key and PREFIX.pub, labelled with PREFIX's name.)
// Public and allowed-clients files decide whom a peer trusts: they are refused when group or
// others may write them.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mlaserve {

struct CurveKeyPair {
  std::string public_key;  // 40 Z85 characters
  std::string secret_key;  // 40 Z85 characters
};

struct AllowedCurveKey {
  std::string public_key;  // 40 Z85 characters
  std::string label;       // the comment line above the key in its file, or "FILE:LINE"
};

// OK when this process's libzmq can do CURVE (it is built with libsodium or tweetnacl), else an
// error that says so and what to install.
absl::Status CheckCurveSupport();

// A fresh key pair from libzmq (zmq_curve_keypair, libsodium's random source).
absl::StatusOr<CurveKeyPair> GenerateCurveKeyPair();

// Reads a key-pair file (mode 0600/0400 only; the public key must match the secret key).
absl::StatusOr<CurveKeyPair> LoadCurveKeyPair(const std::string& path);
// Reads a public-key file. A file holding a secret key is refused: a peer needs only the other
// side's .pub file.
absl::StatusOr<std::string> LoadCurvePublicKey(const std::string& path);
// Reads an allowed-clients file: at least one key, no secret keys, no duplicates.
absl::StatusOr<std::vector<AllowedCurveKey>> LoadAllowedCurveKeys(const std::string& path);

// Writes `prefix`.key (mode 0600) and `prefix`.pub (mode 0644) for `pair`, with `label` in their
// comment line. Refuses to overwrite either file.
absl::Status WriteCurveKeyFiles(const std::string& prefix, const CurveKeyPair& pair,
                                const std::string& label);

// True for endpoints other hosts cannot reach: ipc://, inproc://, and tcp:// on 127.0.0.0/8,
// ::1, localhost or the loopback interface `lo`.
bool IsLoopbackEndpoint(const std::string& endpoint);

}  // namespace mlaserve
