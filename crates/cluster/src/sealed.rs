//! Gossip sealed under the cluster key: every datagram is encrypted and authenticated with
//! XChaCha20-Poly1305 (RustCrypto), so a process without the key can neither join, nor publish
//! members, nor read who the members are. chitchat's transport is pluggable: this one wraps a
//! UDP socket and seals what chitchat sends, opens what it receives, and drops the rest.
//!
//! A datagram is `magic (4) | nonce (24) | ciphertext | tag (16)`; the plaintext is the send time
//! (ms since the epoch, 8 bytes) and chitchat's serialized message; the associated data binds
//! the magic and the cluster id, so a datagram of another cluster does not open either. A
//! datagram older or newer than [`MAX_SKEW`] is dropped (a replay); nodes' clocks must agree
//! within it. Two keys may be accepted at once, for rotation; one of them seals.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use async_trait::async_trait;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use chitchat::transport::{Socket, Transport};
use chitchat::{ChitchatMessage, Deserializable, Serializable};

/// The first bytes of a sealed datagram (and its format's version).
const MAGIC: &[u8; 4] = b"cvg1";
const NONCE_BYTES: usize = 24;
const TAG_BYTES: usize = 16;
const TIME_BYTES: usize = 8;
/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_507;
/// A datagram sent further from now than this is dropped: a replay, or a clock out of step.
pub const MAX_SKEW: Duration = Duration::from_secs(120);
/// Rejected datagrams of one source address are logged at most once per this.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// A cluster key: 32 bytes, shared by every node.
#[derive(Clone)]
pub struct GossipKey([u8; 32]);

impl std::fmt::Debug for GossipKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GossipKey(..)")
    }
}

impl GossipKey {
    /// A key from its 64 hexadecimal digits.
    pub fn from_hex(hex_digits: &str) -> Result<GossipKey, String> {
        let bytes = hex::decode(hex_digits.trim())
            .map_err(|_| "a gossip key is 64 hexadecimal digits (32 bytes)".to_owned())?;
        let bytes: [u8; 32] = bytes
            .try_into()
            .map_err(|_| "a gossip key is 64 hexadecimal digits (32 bytes)".to_owned())?;
        Ok(GossipKey(bytes))
    }

    fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new(&Key::from(self.0))
    }
}

/// The keys of a node: one seals (and opens), another may be accepted too during a rotation.
#[derive(Debug, Clone)]
pub struct GossipKeys {
    /// Seals every datagram this node sends.
    pub seal: GossipKey,
    /// Also opens datagrams (a key being rotated in or out).
    pub accept: Option<GossipKey>,
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rejected {
    /// Too short, or not of this format.
    Malformed,
    /// No accepted key opens it (wrong key, another cluster, or tampered).
    Unauthenticated,
    /// Sent too long ago or too far ahead.
    Stale,
    /// Opened, but chitchat cannot read what it holds.
    Undecodable,
}

impl Rejected {
    fn label(self) -> &'static str {
        match self {
            Rejected::Malformed => "malformed",
            Rejected::Unauthenticated => "unauthenticated",
            Rejected::Stale => "stale",
            Rejected::Undecodable => "undecodable",
        }
    }
}

/// The sealing rules of one cluster: its keys and its id.
struct Sealer {
    seal: XChaCha20Poly1305,
    open: Vec<XChaCha20Poly1305>,
    associated: Vec<u8>,
}

impl Sealer {
    fn new(keys: &GossipKeys, cluster_id: &str) -> Sealer {
        let mut open = vec![keys.seal.cipher()];
        open.extend(keys.accept.iter().map(GossipKey::cipher));
        let mut associated = MAGIC.to_vec();
        associated.extend_from_slice(cluster_id.as_bytes());
        Sealer {
            seal: keys.seal.cipher(),
            open,
            associated,
        }
    }

    fn seal(&self, envelope: &[u8], now_ms: u64) -> Result<Vec<u8>, chacha20poly1305::Error> {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let mut plain = Vec::with_capacity(TIME_BYTES + envelope.len());
        plain.extend_from_slice(&now_ms.to_be_bytes());
        plain.extend_from_slice(envelope);
        let sealed = self.seal.encrypt(
            &nonce,
            Payload {
                msg: &plain,
                aad: &self.associated,
            },
        )?;
        let mut datagram = Vec::with_capacity(MAGIC.len() + NONCE_BYTES + sealed.len());
        datagram.extend_from_slice(MAGIC);
        datagram.extend_from_slice(&nonce);
        datagram.extend_from_slice(&sealed);
        Ok(datagram)
    }

    /// The envelope bytes a datagram holds, when an accepted key opens it and it is fresh.
    fn open(&self, datagram: &[u8], now_ms: u64) -> Result<Vec<u8>, Rejected> {
        let header = MAGIC.len() + NONCE_BYTES;
        if datagram.len() < header + TAG_BYTES + TIME_BYTES || &datagram[..MAGIC.len()] != MAGIC {
            return Err(Rejected::Malformed);
        }
        let mut nonce = XNonce::default();
        nonce.copy_from_slice(&datagram[MAGIC.len()..header]);
        let sealed = &datagram[header..];
        let plain = self
            .open
            .iter()
            .find_map(|cipher| {
                let payload = Payload {
                    msg: sealed,
                    aad: &self.associated,
                };
                cipher.decrypt(&nonce, payload).ok()
            })
            .ok_or(Rejected::Unauthenticated)?;
        let mut sent = [0u8; TIME_BYTES];
        sent.copy_from_slice(&plain[..TIME_BYTES]);
        let sent_ms = u64::from_be_bytes(sent);
        if sent_ms.abs_diff(now_ms) > MAX_SKEW.as_millis() as u64 {
            return Err(Rejected::Stale);
        }
        Ok(plain[TIME_BYTES..].to_vec())
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or_default()
}

/// The gossip transport: chitchat's messages over UDP, sealed under the cluster's keys when it
/// has them, and in every case with rejected datagrams counted and logged at most once a minute
/// per source (a flood of garbage is no flood of log lines).
pub(crate) struct GossipTransport {
    sealer: Option<Arc<Sealer>>,
}

impl GossipTransport {
    /// Sealed under `keys` when given, else in the clear (loopback or explicitly allowed).
    pub(crate) fn new(keys: Option<&GossipKeys>, cluster_id: &str) -> GossipTransport {
        GossipTransport {
            sealer: keys.map(|keys| Arc::new(Sealer::new(keys, cluster_id))),
        }
    }
}

#[async_trait]
impl Transport for GossipTransport {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let socket = tokio::net::UdpSocket::bind(listen_addr)
            .await
            .with_context(|| format!("failed to bind to {listen_addr}/UDP for gossip"))?;
        Ok(Box::new(GossipSocket {
            socket,
            sealer: self.sealer.clone(),
            buffer: vec![0u8; MAX_DATAGRAM].into_boxed_slice(),
            logged: HashMap::new(),
        }))
    }
}

struct GossipSocket {
    socket: tokio::net::UdpSocket,
    sealer: Option<Arc<Sealer>>,
    buffer: Box<[u8]>,
    /// When a rejected datagram of each source was last logged.
    logged: HashMap<IpAddr, Instant>,
}

impl GossipSocket {
    fn rejected(&mut self, from: SocketAddr, reason: Rejected) {
        metrics::counter!("converger_gossip_rejected_total", "reason" => reason.label())
            .increment(1);
        let now = Instant::now();
        if self.logged.len() > 10_000 {
            self.logged
                .retain(|_, at| now.duration_since(*at) < LOG_EVERY);
        }
        let due = self
            .logged
            .get(&from.ip())
            .is_none_or(|at| now.duration_since(*at) >= LOG_EVERY);
        if due {
            self.logged.insert(from.ip(), now);
            tracing::warn!(%from, reason = reason.label(), "gossip datagram dropped (logged once a minute per source)");
        }
    }
}

#[async_trait]
impl Socket for GossipSocket {
    async fn send(&mut self, to: SocketAddr, message: ChitchatMessage) -> anyhow::Result<()> {
        let mut plain = Vec::with_capacity(message.serialized_len());
        message.serialize(&mut plain);
        let datagram = match &self.sealer {
            Some(sealer) => sealer
                .seal(&plain, now_ms())
                .map_err(|_| anyhow::anyhow!("gossip datagram could not be sealed"))?,
            None => plain,
        };
        if datagram.len() > MAX_DATAGRAM {
            // chitchat sizes deltas for a bare UDP payload; a full one plus the seal's 52
            // bytes does not fit. The next round sends a smaller delta.
            anyhow::bail!(
                "sealed gossip datagram of {} bytes is too large",
                datagram.len()
            );
        }
        self.socket
            .send_to(&datagram, to)
            .await
            .context("failed to send a gossip datagram")?;
        Ok(())
    }

    async fn recv(&mut self) -> anyhow::Result<(SocketAddr, ChitchatMessage)> {
        loop {
            let (received, from_addr) = match self.socket.recv_from(&mut self.buffer).await {
                Ok(received) => received,
                Err(error) if is_transient(&error) => continue,
                Err(error) => return Err(error).context("fatal UDP recv error"),
            };
            let datagram = &self.buffer[..received];
            let plain = match &self.sealer {
                Some(sealer) => match sealer.open(datagram, now_ms()) {
                    Ok(plain) => plain,
                    Err(reason) => {
                        self.rejected(from_addr, reason);
                        continue;
                    }
                },
                None => datagram.to_vec(),
            };
            match ChitchatMessage::deserialize(&mut plain.as_slice()) {
                Ok(message) => return Ok((from_addr, message)),
                Err(_) => self.rejected(from_addr, Rejected::Undecodable),
            }
        }
    }
}

fn is_transient(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::OutOfMemory
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionRefused
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(seal: u8, accept: Option<u8>) -> GossipKeys {
        GossipKeys {
            seal: GossipKey([seal; 32]),
            accept: accept.map(|byte| GossipKey([byte; 32])),
        }
    }

    #[test]
    fn only_an_accepted_key_of_the_same_cluster_opens_a_fresh_datagram() {
        let now = 1_000_000_000;
        let sender = Sealer::new(&keys(1, None), "prod");
        let datagram = sender.seal(b"envelope", now).unwrap();
        assert_eq!(
            Sealer::new(&keys(1, None), "prod")
                .open(&datagram, now)
                .unwrap(),
            b"envelope"
        );
        // Rotation: a node that seals with the new key still accepts the old one.
        assert!(
            Sealer::new(&keys(2, Some(1)), "prod")
                .open(&datagram, now)
                .is_ok()
        );
        assert_eq!(
            Sealer::new(&keys(2, None), "prod").open(&datagram, now),
            Err(Rejected::Unauthenticated)
        );
        assert_eq!(
            Sealer::new(&keys(1, None), "staging").open(&datagram, now),
            Err(Rejected::Unauthenticated),
            "another cluster id does not open it"
        );
        let late = now + MAX_SKEW.as_millis() as u64 + 1;
        assert_eq!(
            Sealer::new(&keys(1, None), "prod").open(&datagram, late),
            Err(Rejected::Stale)
        );
        let mut tampered = datagram.clone();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        assert_eq!(
            Sealer::new(&keys(1, None), "prod").open(&tampered, now),
            Err(Rejected::Unauthenticated)
        );
        assert_eq!(
            Sealer::new(&keys(1, None), "prod").open(b"plain chitchat", now),
            Err(Rejected::Malformed)
        );
    }

    #[test]
    fn keys_are_64_hex_digits() {
        assert!(GossipKey::from_hex(&"ab".repeat(32)).is_ok());
        assert!(GossipKey::from_hex("abcd").is_err());
        assert!(GossipKey::from_hex(&"zz".repeat(32)).is_err());
    }
}
