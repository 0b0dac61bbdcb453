#include "coordinator/http/http_exchange.h"

#include <civetweb.h>
#include <strings.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace mlaserve::openai {
namespace {

const char* StatusText(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 413:
      return "Payload Too Large";
    case 429:
      return "Too Many Requests";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return status >= 500 ? "Internal Server Error" : "Error";
  }
}

// Whether a comma-separated header value lists `token` (case-insensitive, exact). Civetweb
// matches a prefix of the token (should_keep_alive in civetweb.c); exact is stricter, so a
// connection this side keeps open civetweb keeps open too.
bool HasToken(const char* value, const char* token) {
  const size_t n = std::strlen(token);
  for (const char* p = value; *p != '\0';) {
    while (*p == ' ' || *p == '\t' || *p == ',') {
      ++p;
    }
    const char* end = p;
    while (*end != '\0' && *end != ',') {
      ++end;
    }
    const char* last = end;
    while (last > p && (last[-1] == ' ' || last[-1] == '\t')) {
      --last;
    }
    if (static_cast<size_t>(last - p) == n && strncasecmp(p, token, n) == 0) {
      return true;
    }
    p = end;
  }
  return false;
}

bool RequestIsChunked(mg_connection* conn) {
  const char* te = mg_get_header(conn, "Transfer-Encoding");
  return te != nullptr && HasToken(te, "chunked");
}

}  // namespace

HttpExchange::Body HttpExchange::ReadBody(size_t limit, std::string& body) {
  const mg_request_info* ri = mg_get_request_info(conn_);
  const bool chunked = RequestIsChunked(conn_);
  if (ri->content_length > static_cast<long long>(limit)) {
    return Body::kTooLarge;
  }
  if (ri->content_length > 0) {
    body.reserve(static_cast<size_t>(ri->content_length));
  }
  char buf[16 << 10];
  for (;;) {
    size_t want = sizeof(buf);
    if (!chunked && ri->content_length > 0) {
      want = std::min(want, static_cast<size_t>(ri->content_length) - body.size());
    }
    if (want == 0) {
      break;
    }
    const int n = mg_read(conn_, buf, want);
    if (n <= 0) {
      break;
    }
    body.append(buf, static_cast<size_t>(n));
    if (body.size() > limit) {
      return Body::kTooLarge;
    }
    // mg_read returns less than asked of a Content-Length body only when the request timeout
    // passed or the client closed: asking again would wait the timeout once more.
    if (!chunked && static_cast<size_t>(n) < want) {
      break;
    }
  }
  if (!chunked && ri->content_length > 0 && body.size() < static_cast<size_t>(ri->content_length)) {
    return Body::kIncomplete;
  }
  // A chunked body is complete when mg_read saw its last chunk; civetweb then counts it as
  // consumed for keep-alive. One cut short reads as complete here and closes the connection.
  body_read_ = true;
  return Body::kOk;
}

bool HttpExchange::KeepAlive() {
  const mg_request_info* ri = mg_get_request_info(conn_);
  bool keep = !close_;
  if (const char* c = mg_get_header(conn_, "Connection"); c != nullptr) {
    keep = keep && HasToken(c, "keep-alive");
  } else {
    keep = keep && ri->http_version != nullptr && std::strcmp(ri->http_version, "1.1") == 0;
  }
  const bool has_body = ri->content_length > 0 || RequestIsChunked(conn_);
  keep = keep && (body_read_ || !has_body);
  if (!keep) {
    mg_disable_connection_keep_alive(conn_);
  }
  return keep;
}

bool HttpExchange::Write(std::string_view bytes) {
  return mg_write(conn_, bytes.data(), bytes.size()) == static_cast<int>(bytes.size());
}

int HttpExchange::WriteJson(int status, const std::string& json_text) {
  head_sent_ = true;
  char head[256];
  std::snprintf(head, sizeof(head),
                "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                "Connection: %s\r\n\r\n",
                status, StatusText(status), json_text.size(), KeepAlive() ? "keep-alive" : "close");
  std::string out = head;
  out += json_text;
  Write(out);
  return status;
}

bool HttpExchange::StartEvents() {
  if (head_sent_) {
    return true;
  }
  head_sent_ = true;
  chunked_ = KeepAlive();
  return Write(chunked_ ? "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                          "Connection: keep-alive\r\n\r\n"
                        : "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          "Cache-Control: no-cache\r\nConnection: close\r\n\r\n");
}

bool HttpExchange::SendEvents(std::string_view text) {
  if (!StartEvents()) {
    return false;
  }
  if (!chunked_) {
    return Write(text);
  }
  char size[24];
  std::snprintf(size, sizeof(size), "%zx\r\n", text.size());
  std::string chunk = size;
  chunk.append(text);
  chunk += "\r\n";
  return Write(chunk);
}

bool HttpExchange::EndEvents() {
  if (!StartEvents()) {
    return false;
  }
  return !chunked_ || Write("0\r\n\r\n");
}

}  // namespace mlaserve::openai
