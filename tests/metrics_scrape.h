// Reads a Prometheus endpoint for the tests that check a live process's metrics: the text of
// GET http://127.0.0.1:PORT/metrics, and one sample's value.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <regex>
#include <string>

namespace mlaserve {

inline std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  std::string body;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    (void)!write(fd, req.data(), req.size());
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) body.append(buf, n);
  }
  close(fd);
  return body;
}

// The value of the first sample of `name` (exact series name, e.g. "mlaserve_preemptions_total")
// in a scrape's text; -1 when there is none.
inline double MetricSample(const std::string& text, const std::string& name) {
  std::regex re("\\n" + name + "(\\{[^}]*\\})? ([0-9.eE+-]+)");
  std::smatch m;
  if (std::regex_search(text, m, re)) return std::stod(m[2].str());
  return -1;
}

}  // namespace mlaserve
