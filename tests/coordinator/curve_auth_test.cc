// Who may talk to the coordinator (issue 24), against the real Coordinator with a fake worker
// (tests/coordinator/coordinator_fixture.h) and the real C++ client:
// - with CURVE on the client socket, a client without keys and a client whose key is not
//   allowed are refused, each with an error that names the cause, while allowed clients keep
//   being served (their streams do not stall);
// - a client holding a wrong server key fails with a clear error, quickly, not at its timeout;
// - request ids are per connection: a second connection (even one holding the same key) cannot
//   abort, or receive, the first one's request of the same id;
// - key files that others may read (secret) or write (public, allowed clients) are refused by
//   the coordinator, the client and the coordinator binary, with the chmod that mends them;
// - the worker socket with the job's key pair: rank 0 holding it is served, one without it or
//   with another pair is not;
// - `mlaserve-cli keygen` writes a usable pair at 0600 / 0644 whatever the umask, never
//   overwriting.
// The fake worker's tokens are the prompt's last token + 1, + 2, ... (mod 512): the oracle for
// which request a stream belongs to.
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "coordinator/auth/curve_keys.h"
#include "coordinator/client/client.h"
#include "gtest/gtest.h"
#include "tests/shell_command.h"
#include "tests/coordinator/coordinator_fixture.h"
#include "tests/model/golden_fixture.h"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using Outcome = ShellOutcome;

Outcome Shell(const std::string& cmd) { return RunShell(cmd); }

GenerateInput Ids(std::vector<int32_t> ids, uint32_t max_tokens) {
  GenerateInput in;
  in.token_ids = std::move(ids);
  in.sampling.max_tokens = max_tokens;
  in.sampling.ignore_eos = true;
  return in;
}

// Reads replies of request `id` until `chunks` chunks arrived; their tokens are appended to
// `tokens`. False (with the failure recorded) on an error, a final, or a timeout.
bool ReadChunks(Client& c, uint64_t id, int chunks, std::vector<int32_t>* tokens) {
  for (int n = 0; n < chunks;) {
    auto r = c.Next(10s);
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      return false;
    }
    EXPECT_EQ(r->request_id, id);
    if (r->kind != Reply::Kind::kChunk) {
      ADD_FAILURE() << "expected a chunk of request " << id << ", got kind "
                    << static_cast<int>(r->kind) << " " << r->finish_reason << r->message;
      return false;
    }
    tokens->insert(tokens->end(), r->token_ids.begin(), r->token_ids.end());
    ++n;
  }
  return true;
}

// Tokens of a stream from the fake worker: each one more than the last, from the prompt's end.
void ExpectCounting(const std::vector<int32_t>& tokens, int32_t after) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    ASSERT_EQ(tokens[i], (after + 1 + static_cast<int32_t>(i)) % 512) << "token " << i;
  }
}

class CurveAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(CheckCurveSupport().ok()) << CheckCurveSupport();
    ASSERT_FALSE(dir_.path().empty());
    for (const char* who : {"server", "alice", "bob", "mallory", "job", "other-job"}) {
      auto pair = GenerateCurveKeyPair();
      ASSERT_TRUE(pair.ok()) << pair.status();
      ASSERT_TRUE(WriteCurveKeyFiles(dir_ / who, *pair, who).ok());
      pairs_[who] = *pair;
    }
    // Allowed: alice and bob (their .pub files concatenated), not mallory.
    std::ofstream(dir_ / "allowed") << Read(dir_ / "alice.pub") << Read(dir_ / "bob.pub");
  }

  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }

  CoordinatorOptions Options(bool curve) {
    CoordinatorOptions o;
    o.model_dir = FixtureDir("kimi-tiny");
    o.client_endpoint = "ipc://" + (dir_ / "clients");
    o.worker_endpoint = "ipc://" + (dir_ / "worker");
    o.metrics_address = "";
    o.worker_start_timeout = 20s;
    if (curve) {
      o.curve_secret_key_file = dir_ / "server.key";
      o.curve_allowed_clients_file = dir_ / "allowed";
    }
    return o;
  }

  // A coordinator and its fake worker; 1 ms a step keeps long requests in flight for seconds.
  void StartServer(bool curve) {
    FakeWorker::Options w;
    w.endpoint = "ipc://" + (dir_ / "worker");
    w.step_delay = 1ms;
    worker_ = std::make_unique<FakeWorker>(w);
    auto s = server_.Start(Options(curve));
    ASSERT_TRUE(s.ok()) << s;
  }

  ClientSecurity As(const std::string& who, const std::string& server = "server") {
    return {dir_ / (server + ".pub"), dir_ / (who + ".key")};
  }
  std::unique_ptr<Client> Connect(const ClientSecurity& security = {}) {
    auto c = Client::Connect("ipc://" + (dir_ / "clients"), security);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  TempDir dir_;
  std::map<std::string, CurveKeyPair> pairs_;
  std::unique_ptr<FakeWorker> worker_;
  InProcessCoordinator server_;  // declared after the worker: stops (drains) first
};

TEST_F(CurveAuthTest, ClientWithoutKeysIsRefusedWhileAllowedClientsAreServed) {
  StartServer(/*curve=*/true);
  auto alice = Connect(As("alice"));
  ASSERT_NE(alice, nullptr);
  auto health = alice->Health(10s);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(health->ok) << health->text;
  // A long request streams while the others knock.
  auto id = alice->Submit(Ids({10, 11, 12}, 100000));
  ASSERT_TRUE(id.ok());
  std::vector<int32_t> streamed;
  ASSERT_TRUE(ReadChunks(*alice, *id, 20, &streamed));

  auto plain = Connect();
  ASSERT_NE(plain, nullptr);
  const auto t0 = Clock::now();
  auto refused = plain->Health(20s);
  ASSERT_FALSE(refused.ok()) << "a client without keys was answered";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  EXPECT_NE(refused.status().message().find("requires CURVE authentication"), std::string::npos)
      << refused.status();
  EXPECT_LT(Clock::now() - t0, 5s) << "the refusal came only at the timeout";
  // Its generate requests are not served either, and the error stays.
  EXPECT_FALSE(plain->Generate(Ids({1, 2}, 3), nullptr, 5s).ok());

  // Alice's stream went on meanwhile, counting up from her prompt; bob is served too.
  ASSERT_TRUE(ReadChunks(*alice, *id, 20, &streamed));
  ExpectCounting(streamed, 12);
  auto bob = Connect(As("bob"));
  auto fin = bob->Generate(Ids({100, 101}, 5), nullptr, 20s);
  ASSERT_TRUE(fin.ok()) << fin.status();
  EXPECT_EQ(fin->finish_reason, "length");
  EXPECT_EQ(fin->token_ids, (std::vector<int32_t>{102, 103, 104, 105, 106}));
  ASSERT_TRUE(alice->Abort(*id).ok());
  for (;;) {
    auto r = alice->Next(10s);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->kind == Reply::Kind::kChunk) continue;
    EXPECT_EQ(r->kind, Reply::Kind::kFinal);
    EXPECT_EQ(r->finish_reason, "abort");
    break;
  }
}

TEST_F(CurveAuthTest, ClientWithUnknownKeyIsRefused) {
  StartServer(/*curve=*/true);
  auto mallory = Connect(As("mallory"));
  ASSERT_NE(mallory, nullptr);
  const auto t0 = Clock::now();
  auto r = mallory->Health(20s);
  ASSERT_FALSE(r.ok()) << "a client with a key not in --curve-allowed-clients was answered";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("is not in the server's --curve-allowed-clients"),
            std::string::npos)
      << r.status();
  EXPECT_LT(Clock::now() - t0, 5s);
  // ZeroMQ does not retry a refused handshake: later calls give the same error at once.
  const auto t1 = Clock::now();
  auto again = mallory->Info(20s);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kPermissionDenied) << again.status();
  EXPECT_LT(Clock::now() - t1, 1s);
  // The allowed keys still work.
  auto alice = Connect(As("alice"));
  auto h = alice->Health(10s);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->ok);
}

TEST_F(CurveAuthTest, WrongServerKeyFailsWithClearError) {
  StartServer(/*curve=*/true);
  // Alice's own key is allowed, but she holds mallory's public key as the server's.
  auto alice = Connect(As("alice", /*server=*/"mallory"));
  ASSERT_NE(alice, nullptr);
  const auto t0 = Clock::now();
  auto r = alice->Health(20s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnauthenticated) << r.status();
  EXPECT_NE(r.status().message().find("--server-key is not this server's public key"),
            std::string::npos)
      << r.status();
  EXPECT_LT(Clock::now() - t0, 5s) << "the failure came only at the timeout";
}

TEST_F(CurveAuthTest, CurveClientOfAPlainServerIsToldSo) {
  StartServer(/*curve=*/false);
  auto alice = Connect(As("alice"));
  auto r = alice->Health(20s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("does not use CURVE"), std::string::npos) << r.status();
  auto plain = Connect();
  auto h = plain->Health(10s);
  ASSERT_TRUE(h.ok()) << h.status();
}

// Both connections' first request has id 1. The second connection's abort of "its" request 1
// finds nothing; the first connection's request runs on and is only aborted by its own abort.
void CrossConnectionAbort(Client& a, Client& b) {
  auto id_a = a.Submit(Ids({10, 11, 12}, 100000));
  ASSERT_TRUE(id_a.ok());
  std::vector<int32_t> streamed;
  ASSERT_TRUE(ReadChunks(a, *id_a, 10, &streamed));

  ASSERT_TRUE(b.Abort(*id_a).ok());
  auto err = b.Next(10s);
  ASSERT_TRUE(err.ok()) << err.status();
  EXPECT_EQ(err->request_id, *id_a);
  EXPECT_EQ(err->kind, Reply::Kind::kError);
  EXPECT_EQ(err->error_code, "notFound") << err->message;
  // b's own request gets the same id and only its own tokens.
  auto fin = b.Generate(Ids({200, 201}, 3), nullptr, 20s);
  ASSERT_TRUE(fin.ok()) << fin.status();
  EXPECT_EQ(fin->request_id, *id_a);
  EXPECT_EQ(fin->finish_reason, "length");
  EXPECT_EQ(fin->token_ids, (std::vector<int32_t>{202, 203, 204}));
  auto nothing = b.Next(300ms);
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kDeadlineExceeded)
      << "b received a reply that is not its own";

  // a's request kept streaming after both, and is a's to abort.
  const size_t before = streamed.size();
  ASSERT_TRUE(ReadChunks(a, *id_a, 10, &streamed));
  ASSERT_TRUE(a.Abort(*id_a).ok());
  for (;;) {
    auto r = a.Next(10s);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->request_id, *id_a);
    if (r->kind == Reply::Kind::kChunk) {
      streamed.insert(streamed.end(), r->token_ids.begin(), r->token_ids.end());
      continue;
    }
    ASSERT_EQ(r->kind, Reply::Kind::kFinal);
    EXPECT_EQ(r->finish_reason, "abort");
    EXPECT_EQ(r->token_ids, streamed);
    break;
  }
  EXPECT_GT(streamed.size(), before);
  ExpectCounting(streamed, 12);
}

TEST_F(CurveAuthTest, OneConnectionCannotAbortAnothersRequestPlain) {
  StartServer(/*curve=*/false);
  auto a = Connect(), b = Connect();
  CrossConnectionAbort(*a, *b);
}

TEST_F(CurveAuthTest, OneConnectionCannotAbortAnothersRequestSameKey) {
  StartServer(/*curve=*/true);
  // Scoping is by connection, not by key: both connections hold alice's key.
  auto a = Connect(As("alice")), b = Connect(As("alice"));
  CrossConnectionAbort(*a, *b);
}

TEST_F(CurveAuthTest, LooseKeyFilePermissionsAreRejected) {
  FakeWorker::Options w;
  w.endpoint = "ipc://" + (dir_ / "worker");
  worker_ = std::make_unique<FakeWorker>(w);
  auto start_fails = [&](const std::string& file, mode_t mode, const std::string& message) {
    ASSERT_EQ(::chmod(file.c_str(), mode), 0);
    Coordinator c(Options(true));
    auto s = c.Start();
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_NE(s.message().find(message), std::string::npos) << s;
  };
  // Secret: any group or other bit is refused.
  for (mode_t m : {0644, 0640, 0604, 0660}) {
    start_fails(dir_ / "server.key", m, "only its owner may read it (chmod 600 ");
  }
  ASSERT_EQ(::chmod((dir_ / "server.key").c_str(), 0600), 0);
  // Trusted lists: group or other write is refused.
  for (mode_t m : {0664, 0646, 0666}) {
    start_fails(dir_ / "allowed", m, "group or others may write it");
  }
  ASSERT_EQ(::chmod((dir_ / "allowed").c_str(), 0644), 0);
  // The job key of the worker socket is a secret key file too.
  ASSERT_EQ(::chmod((dir_ / "job.key").c_str(), 0644), 0);
  {
    CoordinatorOptions o = Options(false);
    o.worker_curve_key_file = dir_ / "job.key";
    Coordinator c(o);
    auto s = c.Start();
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  }
  // Owner-only modes are accepted: 0400 and 0600 (the server starts).
  ASSERT_EQ(::chmod((dir_ / "server.key").c_str(), 0400), 0);
  worker_.reset();
  StartServer(/*curve=*/true);
  EXPECT_EQ(server_.Stop(), 0);

  // The client refuses its own loose files before connecting.
  ASSERT_EQ(::chmod((dir_ / "alice.key").c_str(), 0640), 0);
  auto c = Client::Connect("ipc://" + (dir_ / "clients"), As("alice"));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("chmod 600 " + (dir_ / "alice.key")), std::string::npos)
      << c.status();
  ASSERT_EQ(::chmod((dir_ / "alice.key").c_str(), 0600), 0);
  ASSERT_EQ(::chmod((dir_ / "server.pub").c_str(), 0666), 0);
  c = Client::Connect("ipc://" + (dir_ / "clients"), As("alice"));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("chmod 644 " + (dir_ / "server.pub")), std::string::npos)
      << c.status();
  ASSERT_EQ(::chmod((dir_ / "server.pub").c_str(), 0644), 0);

  // The binary: exit status 1 and the message, before it waits for any worker.
  ASSERT_EQ(::chmod((dir_ / "server.key").c_str(), 0644), 0);
  Outcome r = Shell(std::string(MLASERVE_COORDINATOR_BIN) + " --model " + FixtureDir("kimi-tiny") +
                    " --listen ipc://" + (dir_ / "c2") + " --worker-listen ipc://" + (dir_ / "w2") +
                    " --metrics off --worker-start-timeout-ms 60000 --curve-secret-key " +
                    (dir_ / "server.key") + " --curve-allowed-clients " + (dir_ / "allowed"));
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("mlaserve-coordinator: key file " + (dir_ / "server.key") +
                       " has mode 0644: it holds a secret key, so only its owner may read it"),
            std::string::npos)
      << r.out;
}

TEST_F(CurveAuthTest, KeyFilesAreChecked) {
  auto write = [&](const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = dir_ / name;
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
    return path;
  };
  const CurveKeyPair& a = pairs_["alice"];
  const CurveKeyPair& b = pairs_["bob"];
  // A pair whose public key is another key's.
  auto s = LoadCurveKeyPair(write(
      "mixed.key", "public-key " + b.public_key + "\nsecret-key " + a.secret_key + "\n", 0600));
  EXPECT_NE(s.status().message().find("is not the public key of its secret-key"), std::string::npos)
      << s.status();
  // Not 40 Z85 characters, named by line.
  s = LoadCurveKeyPair(write("short.key", "# x\n\npublic-key abc\n", 0600));
  EXPECT_NE(s.status().message().find("short.key:3: public-key is not a 40-character Z85 key"),
            std::string::npos)
      << s.status();
  // Half a pair.
  s = LoadCurveKeyPair(write("half.key", "public-key " + a.public_key + "\n", 0600));
  EXPECT_NE(s.status().message().find("needs a public-key and a secret-key line"),
            std::string::npos)
      << s.status();
  // Allowed clients: a secret key, no key, a key twice.
  auto l = LoadAllowedCurveKeys(write("a1", Read(dir_ / "alice.key"), 0644));
  EXPECT_NE(l.status().message().find("holds a secret key"), std::string::npos) << l.status();
  l = LoadAllowedCurveKeys(write("a2", "# nobody\n", 0644));
  EXPECT_NE(l.status().message().find("names no client"), std::string::npos) << l.status();
  l = LoadAllowedCurveKeys(write("a3", Read(dir_ / "bob.pub") + Read(dir_ / "bob.pub"), 0644));
  EXPECT_NE(l.status().message().find("key listed twice"), std::string::npos) << l.status();
  // The labels are the comment lines above the keys (keygen writes the name there).
  l = LoadAllowedCurveKeys(dir_ / "allowed");
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_EQ(l->size(), 2u);
  EXPECT_EQ((*l)[0].public_key, a.public_key);
  EXPECT_EQ((*l)[0].label, "alice");
  EXPECT_EQ((*l)[1].label, "bob");
  // A client's server key must be a public-key file.
  auto p = LoadCurvePublicKey(dir_ / "server.key");
  EXPECT_NE(p.status().message().find("give the peer's public-key file (.pub)"), std::string::npos)
      << p.status();
  // The server's two CURVE flags go together.
  CoordinatorOptions o = Options(true);
  o.curve_allowed_clients_file.clear();
  Coordinator c(o);
  auto st = c.Start();
  EXPECT_NE(st.message().find("--curve-secret-key needs --curve-allowed-clients"),
            std::string::npos)
      << st;
  auto half = Client::Connect("ipc://x", {dir_ / "server.pub", ""});
  EXPECT_FALSE(half.ok());
}

TEST_F(CurveAuthTest, WorkerSocketTakesOnlyTheJobKey) {
  auto start = [&](std::optional<CurveKeyPair> worker_pair, const std::string& server_key) {
    FakeWorker::Options w;
    w.endpoint = "ipc://" + (dir_ / "worker");
    w.curve = std::move(worker_pair);
    w.server_key = server_key;
    worker_ = std::make_unique<FakeWorker>(w);
    CoordinatorOptions o = Options(false);
    o.worker_curve_key_file = dir_ / "job.key";
    o.worker_start_timeout = 1500ms;
    return server_.Start(o);
  };
  // Rank 0 without CURVE; with another job's pair; with another pair but the job's public key
  // (refused by the ZAP handler, not by the handshake): no `ready` gets through.
  const std::string job_public = pairs_["job"].public_key;
  const std::vector<std::pair<std::optional<CurveKeyPair>, std::string>> impostors = {
      {std::nullopt, ""}, {pairs_["other-job"], ""}, {pairs_["other-job"], job_public}};
  for (const auto& [pair, server_key] : impostors) {
    auto s = start(pair, server_key);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("no worker connected"), std::string::npos) << s;
    server_.Stop();
    worker_.reset();
  }
  // With the job's pair it is served.
  auto s = start(pairs_["job"], "");
  ASSERT_TRUE(s.ok()) << s;
  auto c = Connect();
  auto fin = c->Generate(Ids({1, 2, 3}, 4), nullptr, 20s);
  ASSERT_TRUE(fin.ok()) << fin.status();
  EXPECT_EQ(fin->token_ids, (std::vector<int32_t>{4, 5, 6, 7}));
}

TEST_F(CurveAuthTest, KeygenWritesOwnerOnlyKeyFiles) {
  const std::string cli = MLASERVE_CLI_BIN;
  const std::string prefix = dir_ / "carol";
  // umask 000 would leave a plain open() at 0666.
  Outcome r = Shell("umask 000; " + cli + " keygen " + prefix + " --label carol-laptop");
  ASSERT_EQ(r.rc, 0) << r.out;
  struct stat key {
  }, pub{};
  ASSERT_EQ(::stat((prefix + ".key").c_str(), &key), 0);
  ASSERT_EQ(::stat((prefix + ".pub").c_str(), &pub), 0);
  EXPECT_EQ(key.st_mode & 07777, 0600u);
  EXPECT_EQ(pub.st_mode & 07777, 0644u);
  auto pair = LoadCurveKeyPair(prefix + ".key");
  ASSERT_TRUE(pair.ok()) << pair.status();
  auto public_key = LoadCurvePublicKey(prefix + ".pub");
  ASSERT_TRUE(public_key.ok()) << public_key.status();
  EXPECT_EQ(*public_key, pair->public_key);
  EXPECT_NE(r.out.find(pair->public_key), std::string::npos) << r.out;
  auto allowed = LoadAllowedCurveKeys(prefix + ".pub");
  ASSERT_TRUE(allowed.ok());
  EXPECT_EQ((*allowed)[0].label, "carol-laptop");
  // A second keygen does not overwrite.
  r = Shell(cli + " keygen " + prefix);
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("carol.key exists: not overwritten"), std::string::npos) << r.out;
  auto same = LoadCurveKeyPair(prefix + ".key");
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->secret_key, pair->secret_key);
  // The CLI's own flags reach a CURVE server: carol is refused until allowed.
  std::ofstream(dir_ / "allowed", std::ios::app) << Read(prefix + ".pub");
  StartServer(/*curve=*/true);
  const std::string flags = " --endpoint ipc://" + (dir_ / "clients") + " --server-key " +
                            (dir_ / "server.pub") + " --client-key " + prefix + ".key";
  r = Shell(cli + flags + " generate --ids 7,8 --max-tokens 2 --json");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\"token_ids\":[9,10]"), std::string::npos) << r.out;
  r = Shell(cli + " --endpoint ipc://" + (dir_ / "clients") + " health");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("requires CURVE authentication"), std::string::npos) << r.out;
}

TEST(LoopbackEndpointTest, OnlyLocalEndpointsAreLoopback) {
  for (const char* e : {"ipc:///tmp/x", "inproc://x", "tcp://127.0.0.1:5555", "tcp://127.1.2.3:1",
                        "tcp://localhost:5555", "tcp://[::1]:5555", "tcp://lo:5555"}) {
    EXPECT_TRUE(IsLoopbackEndpoint(e)) << e;
  }
  for (const char* e :
       {"tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.5:5555", "tcp://127.example.com:5555",
        "tcp://[::]:5555", "tcp://eth0:5555", "tcp://128.0.0.1:1"}) {
    EXPECT_FALSE(IsLoopbackEndpoint(e)) << e;
  }
}

}  // namespace
}  // namespace mlaserve
