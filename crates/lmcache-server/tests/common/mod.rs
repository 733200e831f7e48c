//! Shared helpers of the HTTP tests.
#![allow(dead_code, missing_docs, clippy::allow_attributes)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use lmcache_server::Server;

/// One request to the server's HTTP API, waiting at most `timeout` for the answer; returns
/// (status, body).
pub fn http_raw(
    s: &Server,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> (u16, String) {
    let mut c = TcpStream::connect(s.http_addr().unwrap()).unwrap();
    c.set_read_timeout(Some(timeout)).unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}
