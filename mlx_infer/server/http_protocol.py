"""The HTTP/1.1 protocol the server runs on: uvicorn's own (h11, or httptools when installed), whose answer
to a request it cannot parse (a malformed request line or header, e.g. `Content-Length: abc`) is an OpenAI
error object in JSON, as every other error of the server, instead of uvicorn's plain-text 400.

    uvicorn.Config(app, http=JSONErrorProtocol, ...)
"""

import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .protocol import APIError

#: What the 400 says: the request never reached the app, so no field is named.
BAD_HTTP_MESSAGE = ("the request is not valid HTTP/1.1 (a malformed request line or header, e.g. a "
                    "Content-Length that is not a number): fix the request")


def bad_http_response(message: str = BAD_HTTP_MESSAGE) -> bytes:
    """The whole HTTP/1.1 400 response (status line, headers, JSON body) for an unparsable request; it
    closes the connection."""
    body = json.dumps(APIError(400, message).body()).encode()
    head = (f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode("ascii")
    return head + body


class JSONErrorProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP/1.1 protocol answering unparsable requests with `bad_http_response()`."""

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn (with its own plain-text message) when the parser rejects the request."""
        self.transport.write(bad_http_response())
        self.transport.close()
