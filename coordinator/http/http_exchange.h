// One HTTP request and its response on a civetweb connection: the body read within a size
// limit, a JSON response or a server-sent-event stream written, and whether the connection then
// stays open for the client's next request (HTTP/1.1 keep-alive, as the `openai` clients' agents
// use it).
//
// The connection closes after the response when the client asked for it (`Connection: close`,
// or HTTP/1.0 without keep-alive), when the request body was not read to its end (an error
// answered before reading it, a body over the limit), or when CloseAfterResponse() says so.
// Civetweb would otherwise read and discard the unread body before the next request, waiting up
// to its request timeout for bytes a client may never send (a 413 for an announced 9 MiB body
// held the connection 30 s that way). Closing with unread bytes lets the kernel answer a client
// still sending them with a reset; the response is already in its receive buffer by then.
//
// A kept-alive event stream is sent with chunked transfer encoding (its end is the last chunk);
// otherwise it ends when the connection closes. Each response part goes out in one write.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

struct mg_connection;

namespace mlaserve::openai {

class HttpExchange {
 public:
  explicit HttpExchange(mg_connection* conn) : conn_(conn) {}
  HttpExchange(const HttpExchange&) = delete;
  HttpExchange& operator=(const HttpExchange&) = delete;

  enum class Body { kOk, kTooLarge, kIncomplete };
  // Reads the whole request body (Content-Length or chunked) into `body`, at most `limit` bytes.
  // kTooLarge: announced or found larger (nothing more is read); kIncomplete: the client
  // stopped sending (closed, or the request timeout passed) before the announced end.
  Body ReadBody(size_t limit, std::string& body);

  // A complete response with a JSON body; returns `status`.
  int WriteJson(int status, const std::string& json_text);

  // The event stream: the response head once (on the first event), then events, then the end.
  // Each returns false when the client is gone.
  bool StartEvents();
  bool SendEvents(std::string_view text);  // one or more "data: ...\n\n" / ": ...\n\n" events
  bool EndEvents();
  bool events_started() const { return head_sent_; }

  void CloseAfterResponse() { close_ = true; }

 private:
  // Decides, when the response head is written, whether the connection stays open (and tells
  // civetweb when it does not); returns the decision.
  bool KeepAlive();
  bool Write(std::string_view bytes);

  mg_connection* conn_;
  bool body_read_ = false;
  bool close_ = false;
  bool head_sent_ = false;
  bool chunked_ = false;
};

}  // namespace mlaserve::openai
