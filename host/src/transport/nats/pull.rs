//! The pull requests of a consumer, sent by the host itself so that a drain
//! can stop asking (module docs of [`super`], "Pulling").

use std::time::Instant;

use async_nats::Subject;
use bytes::Bytes;
use futures::{FutureExt as _, StreamExt as _};

use super::conn::{PULL_EXPIRES, PULL_GRACE, SYSTEM};

/// The pull requests of one consumer, sent by the host on an inbox of its
/// own (module docs, "Pulling"): one open request at a time, for up to
/// `batch` messages, expiring after [`PULL_EXPIRES`]; the next is sent when
/// it is fulfilled, expires (408) or ends (409), so the server's
/// `MaxAckPending` alone bounds what the node holds. A request that neither
/// brings its batch nor ends within [`PULL_GRACE`] of its expiry ends the
/// subscription (the supervisor subscribes again).
pub(super) struct Puller {
    pub(super) client: async_nats::Client,
    pub(super) inbox: async_nats::Subscriber,
    pub(super) reply: Subject,
    pub(super) request: Subject,
    pub(super) body: Bytes,
    pub(super) batch: u32,
    /// The open request: messages it may still bring, and when the server
    /// forgets it.
    pub(super) open: Option<(u32, Instant)>,
    /// Set by [`Puller::stop`]: no more requests.
    pub(super) stopped: bool,
    pub(super) ended: bool,
}

/// What one message on the inbox means.
pub(super) enum Heard {
    Message(async_nats::Message),
    Nothing,
    Ended(String),
}

impl Puller {
    pub(super) async fn start(
        client: &async_nats::Client,
        stream: &str,
        consumer: &str,
        batch: u32,
    ) -> Result<Self, async_nats::SubscribeError> {
        let reply = Subject::from(client.new_inbox());
        let inbox = client.subscribe(reply.clone()).await?;
        let body = format!("{{\"batch\":{batch},\"expires\":{}}}", PULL_EXPIRES.as_nanos(),);
        Ok(Self {
            client: client.clone(),
            inbox,
            reply,
            request: Subject::from(format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}")),
            body: Bytes::from(body),
            batch,
            open: None,
            stopped: false,
            ended: false,
        })
    }

    /// Sort one inbox message: a delivery, a status that needs nothing, or
    /// one that ends the subscription.
    fn hear(&mut self, m: async_nats::Message) -> Heard {
        match m.status {
            None => {
                if let Some((left, _)) = &mut self.open {
                    *left = left.saturating_sub(1);
                    if *left == 0 {
                        self.open = None;
                    }
                }
                if m.reply.is_some() {
                    Heard::Message(m)
                } else {
                    Heard::Nothing
                }
            }
            Some(async_nats::StatusCode::IDLE_HEARTBEAT) => Heard::Nothing,
            // The request expired, or found nothing: send another.
            Some(async_nats::StatusCode::TIMEOUT | async_nats::StatusCode::NOT_FOUND) => {
                self.open = None;
                Heard::Nothing
            }
            Some(code) => {
                let what = m.description.unwrap_or_default();
                if code == async_nats::StatusCode::REQUEST_TERMINATED && !what.to_ascii_lowercase().contains("deleted")
                {
                    // Exceeded MaxWaiting or MaxBytes, a leadership change:
                    // this request is over, the consumer is not.
                    tracing::debug!(messaging.system = SYSTEM, status = %code, description = %what, "pull request ended");
                    self.open = None;
                    Heard::Nothing
                } else {
                    Heard::Ended(format!("the server answered {code} {what}"))
                }
            }
        }
    }

    /// The next delivery; `None` once stopped and the open request ended.
    /// Cancel-safe: a request sent twice is harmless, and no message is
    /// held across an await.
    pub(super) async fn next(&mut self) -> Option<Result<async_nats::Message, String>> {
        loop {
            if self.ended {
                return None;
            }
            if self.open.is_none() {
                if self.stopped {
                    self.ended = true;
                    return None;
                }
                if let Err(e) = self
                    .client
                    .publish_with_reply(self.request.clone(), self.reply.clone(), self.body.clone())
                    .await
                {
                    self.ended = true;
                    return Some(Err(format!("sending a pull request: {e}")));
                }
                self.open = Some((self.batch, Instant::now() + PULL_EXPIRES));
            }
            let deadline = self.open.map_or_else(Instant::now, |(_, expires)| expires + PULL_GRACE);
            match tokio::time::timeout_at(deadline.into(), self.inbox.next()).await {
                Ok(Some(m)) => match self.hear(m) {
                    Heard::Message(m) => return Some(Ok(m)),
                    Heard::Nothing => {}
                    Heard::Ended(why) => {
                        self.ended = true;
                        return Some(Err(why));
                    }
                },
                Ok(None) => {
                    self.ended = true;
                    return Some(Err("the inbox subscription closed".to_owned()));
                }
                Err(_) if self.stopped => {
                    tracing::warn!(messaging.system = SYSTEM, inbox = %self.reply, "the open pull request did not end in time; what it brings later is redelivered after AckWait");
                    self.ended = true;
                    return None;
                }
                Err(_) => {
                    self.ended = true;
                    return Some(Err(format!(
                        "no answer to a pull request {PULL_GRACE:?} after its expiry ({PULL_EXPIRES:?})"
                    )));
                }
            }
        }
    }

    /// A delivery already on the inbox, without waiting or asking for more.
    pub(super) fn try_next(&mut self) -> Option<Result<async_nats::Message, String>> {
        while !self.ended {
            let m = self.inbox.next().now_or_never()?;
            let Some(m) = m else {
                self.ended = true;
                return Some(Err("the inbox subscription closed".to_owned()));
            };
            match self.hear(m) {
                Heard::Message(m) => return Some(Ok(m)),
                Heard::Nothing => {}
                Heard::Ended(why) => {
                    self.ended = true;
                    return Some(Err(why));
                }
            }
        }
        None
    }

    /// Send no more pull requests: [`Puller::next`] yields what the open
    /// request still brings and ends when it is fulfilled or expires (the
    /// server's 408, which comes after every message of that request). Only
    /// then is anything released, so no waiting request of this node is left
    /// on the server to take a released message, or a new one, into an inbox
    /// that is gone.
    pub(super) fn stop(&mut self) {
        self.stopped = true;
    }
}
