// A real Coordinator (the class mlaserve-coordinator runs) in the test process, served by a fake
// worker rank 0: a thread speaking the worker side of the step protocol with no model (each
// sampled token is the sequence's last token + 1 mod the vocabulary), optionally over CURVE with
// the job's key pair. For tests of the coordinator's sockets: no mpirun, no weights, starts in
// milliseconds. The model folder only gives the coordinator its tokenizer files (FixtureDir of
// tests/model/golden_fixture.h; kimi-tiny has none: token-id requests).
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "capnp/message.h"
#include "capnp/serialize.h"
#include "coordinator/auth/curve_keys.h"
#include "coordinator/server/coordinator.h"
#include "mlaserve.capnp.h"
#include "nlohmann/json.hpp"
#include "zmq.hpp"

namespace mlaserve {

// A private folder (mode 0700) for sockets and key files, removed with the object.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "mlaserve-auth-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

class FakeWorker {
 public:
  struct Options {
    std::string endpoint;
    std::optional<CurveKeyPair> curve;  // the job's key pair, as rank 0 would use it
    std::string server_key;             // the coordinator's public key; empty: curve's own
    std::chrono::microseconds step_delay{0};
    int vocab = 512;
    int kv_blocks = 4096;
    // Ranks of the job: rank 0 answers steps and beats as "heartbeat"; ranks 1.. beat as
    // "heartbeat-R", each on a socket of its own, as the real ranks do.
    int ranks = 1;
  };

  explicit FakeWorker(Options o) : o_(std::move(o)) {
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeWorker() {
    stop_.store(true);
    thread_.join();
  }
  int steps() const { return steps_.load(); }
  // As if rank r died: its sockets close (rank 0: the job stops answering, too).
  void KillRank(int r) { kill_rank_.store(r); }
  // As if rank r hung: its beats stop, its connection stays.
  void SilenceRank(int r) { silent_rank_.store(r); }
  // True once the coordinator sent a shutdown (it ends the job it gave up on, or drains).
  bool told_to_stop() const { return told_to_stop_.load(); }

 private:
  void Configure(zmq::socket_t& s, const char* routing_id) {
    s.set(zmq::sockopt::routing_id, routing_id);
    s.set(zmq::sockopt::linger, 0);
    if (o_.curve) {
      s.set(zmq::sockopt::curve_serverkey,
            o_.server_key.empty() ? o_.curve->public_key : o_.server_key);
      s.set(zmq::sockopt::curve_publickey, o_.curve->public_key);
      s.set(zmq::sockopt::curve_secretkey, o_.curve->secret_key);
    }
    s.connect(o_.endpoint);
  }
  static void Send(zmq::socket_t& s, capnp::MessageBuilder& msg) {
    kj::Array<capnp::word> w = capnp::messageToFlatArray(msg);
    auto b = w.asBytes();
    (void)s.send(zmq::const_buffer(b.begin(), b.size()), zmq::send_flags::dontwait);
  }
  void Serve() {
    zmq::context_t ctx(1);
    zmq::socket_t sock(ctx, zmq::socket_type::dealer);
    std::vector<std::unique_ptr<zmq::socket_t>> hb;
    for (int r = 0; r < o_.ranks; ++r) {
      hb.push_back(std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer));
      Configure(*hb.back(), r == 0 ? "heartbeat" : ("heartbeat-" + std::to_string(r)).c_str());
    }
    Configure(sock, "worker");
    {
      nlohmann::json info = {{"model", "fake"},
                             {"ranks", o_.ranks},
                             {"kv_format", "none"},
                             {"kv_blocks", o_.kv_blocks},
                             {"vocab_size", o_.vocab},
                             {"max_position_embeddings", 1 << 20},
                             {"eos_token_ids", nlohmann::json::array()},
                             {"backend", "fake"}};
      std::vector<int> beating;
      for (int r = 0; r < o_.ranks; ++r) beating.push_back(r);
      info["heartbeat_ranks"] = beating;
      capnp::MallocMessageBuilder msg;
      msg.initRoot<wire::StepResult>().setReady(info.dump());
      Send(sock, msg);
    }
    capnp::MallocMessageBuilder beat;
    beat.initRoot<wire::StepResult>().setPong();
    auto last_beat = std::chrono::steady_clock::now() - std::chrono::seconds(1);
    while (!stop_.load()) {
      const int dead = kill_rank_.exchange(-1);
      if (dead == 0) {
        // Rank 0's sockets close first and the other ranks' a moment later, as when mpirun ends
        // a job whose rank 0 died (all at once, the coordinator could see any rank's close first).
        hb[0].reset();
        sock.close();
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        return;  // the other ranks' sockets close with the context
      }
      if (dead > 0 && dead < o_.ranks) hb[dead].reset();
      if (std::chrono::steady_clock::now() - last_beat > std::chrono::milliseconds(250)) {
        for (int r = 0; r < o_.ranks; ++r) {
          if (hb[r] != nullptr && r != silent_rank_.load()) Send(*hb[r], beat);
        }
        last_beat = std::chrono::steady_clock::now();
      }
      zmq::pollitem_t items[] = {{sock.handle(), 0, ZMQ_POLLIN, 0},
                                 {hb[0]->handle(), 0, ZMQ_POLLIN, 0}};
      if (zmq::poll(items, 2, std::chrono::milliseconds(50)) == 0) continue;
      if (items[1].revents & ZMQ_POLLIN) {
        zmq::message_t m;
        if (hb[0]->recv(m, zmq::recv_flags::dontwait)) told_to_stop_.store(true);
      }
      if (!(items[0].revents & ZMQ_POLLIN)) continue;
      zmq::message_t m;
      if (!sock.recv(m) || m.size() % sizeof(capnp::word) != 0) continue;
      kj::Array<capnp::word> words = kj::heapArray<capnp::word>(m.size() / sizeof(capnp::word));
      std::memcpy(words.begin(), m.data(), m.size());
      capnp::FlatArrayMessageReader reader(words);
      auto plan = reader.getRoot<wire::StepPlan>();
      if (plan.isShutdown()) {
        told_to_stop_.store(true);
        break;
      }
      if (!plan.isStep()) continue;
      if (o_.step_delay.count() > 0) std::this_thread::sleep_for(o_.step_delay);
      capnp::MallocMessageBuilder msg;
      auto r = msg.initRoot<wire::StepResult>();
      r.setStepId(plan.getStepId());
      int n = 0;
      for (auto s : plan.getStep()) n += s.getSample();
      auto list = r.initSampled(n);
      int i = 0;
      for (auto s : plan.getStep()) {
        if (!s.getSample()) continue;
        list[i].setSeqId(s.getSeqId());
        list[i].setTokenId((s.getTokens()[s.getTokens().size() - 1] + 1) % o_.vocab);
        ++i;
      }
      r.initRankSeconds(1).set(0, 0.0);
      Send(sock, msg);
      steps_.fetch_add(1);
    }
  }

  Options o_;
  std::atomic<bool> stop_{false};
  std::atomic<int> kill_rank_{-1};
  std::atomic<int> silent_rank_{-1};
  std::atomic<bool> told_to_stop_{false};
  std::atomic<int> steps_{0};
  std::thread thread_;
};

// Coordinator::Start on the calling thread (it waits for the fake worker's `ready`), Run on a
// thread of its own until Stop (drain) or destruction.
class InProcessCoordinator {
 public:
  ~InProcessCoordinator() { Stop(); }

  absl::Status Start(CoordinatorOptions o) {
    coordinator_ = std::make_unique<Coordinator>(std::move(o));
    if (auto s = coordinator_->Start(); !s.ok()) return s;
    run_ = std::thread([this] { rc_ = coordinator_->Run(); });
    return absl::OkStatus();
  }
  int metrics_port() const { return coordinator_ ? coordinator_->metrics_port() : 0; }
  int Stop() {
    if (run_.joinable()) {
      coordinator_->RequestShutdown();
      run_.join();
    }
    coordinator_.reset();
    return rc_;
  }

 private:
  std::unique_ptr<Coordinator> coordinator_;
  std::thread run_;
  int rc_ = -1;
};

}  // namespace mlaserve
