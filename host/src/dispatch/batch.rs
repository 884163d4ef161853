//! Taking a batch from a lane's head: its run of members of the same rule,
//! tenant and group, up to the rule's size, once it is full, meets a
//! boundary, or its oldest member has lingered.

use std::sync::Arc;
use std::time::Instant;

use crate::observe::stats::FlushReason;
use crate::router::BatchRule;
use crate::transport::Delivery;

use super::lane::Lane;

/// What the head of a lane gives when its head is a batched message.
pub enum Take {
    /// Run these members now, for this reason.
    Batch(Vec<Delivery>, FlushReason),
    /// Not yet: the batch may grow until this instant.
    Wait(Instant),
}

/// Take the batch at the head of `lane`: the head and the members after it
/// of the same rule, tenant and group, up to the rule's size. `window_full`:
/// the slot can receive nothing more until something settles, so a partial
/// batch runs now instead of lingering (it could not grow before then).
pub fn take_batch(lane: &mut Lane, rule: &Arc<BatchRule>, now: Instant, window_full: bool) -> Take {
    let Some(head) = lane.queue.front() else {
        return Take::Wait(now);
    };
    let (tenant, group) = head
        .env()
        .map(|e| (e.tenant_id.clone(), e.group_id.clone()))
        .unwrap_or_default();
    let oldest = head.at;
    let mut n = 0;
    let mut boundary = false;
    for q in &lane.queue {
        if n == rule.size {
            break;
        }
        let joins = q.batch.as_ref().is_some_and(|r| Arc::ptr_eq(r, rule))
            && q.env().is_some_and(|e| e.tenant_id == tenant && e.group_id == group);
        if !joins {
            boundary = true;
            break;
        }
        n += 1;
    }
    let reason = if n == rule.size {
        FlushReason::Size
    } else if boundary {
        FlushReason::Boundary
    } else if now >= oldest + rule.linger {
        FlushReason::Linger
    } else if window_full {
        FlushReason::Window
    } else {
        return Take::Wait(oldest + rule.linger);
    };
    Take::Batch(lane.queue.drain(..n).map(|q| q.d).collect(), reason)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::dispatch::lane::Queued;
    use crate::envelope;
    use crate::transport::{Acker, Disposition};

    struct NoAck;

    #[async_trait::async_trait]
    impl Acker for NoAck {
        async fn settle(self: Box<Self>, _: Disposition) -> Result<(), crate::transport::TransportError> {
            Ok(())
        }
    }

    fn rule(size: usize) -> Arc<BatchRule> {
        Arc::new(BatchRule {
            handler: Arc::from("h"),
            size,
            linger: Duration::from_millis(20),
        })
    }

    fn queued(rule: Option<&Arc<BatchRule>>, group: &str, tenant: &str, at: Instant) -> Queued {
        let env = envelope::new_message(
            envelope::fresh_id(),
            "t",
            Some(group.to_owned()),
            Some(tenant.to_owned()),
            vec![],
            vec![],
        );
        Queued {
            d: Delivery {
                message: Ok(env),
                source: Arc::from("q"),
                tag: 0,
                acker: Box::new(NoAck),
            },
            at,
            batch: rule.cloned(),
            park: false,
        }
    }

    fn lane(items: Vec<Queued>) -> Lane {
        Lane {
            queue: items.into(),
            ..Lane::default()
        }
    }

    fn taken(t: Take) -> (usize, Option<FlushReason>) {
        match t {
            Take::Batch(members, reason) => (members.len(), Some(reason)),
            Take::Wait(_) => (0, None),
        }
    }

    #[test]
    fn a_full_batch_goes_at_size_and_leaves_the_rest() {
        let (r, now) = (rule(2), Instant::now());
        let mut l = lane((0..3).map(|_| queued(Some(&r), "g", "a", now)).collect());
        assert_eq!(taken(take_batch(&mut l, &r, now, false)), (2, Some(FlushReason::Size)));
        assert_eq!(l.queue.len(), 1);
    }

    #[test]
    fn a_batch_stops_at_another_tenant_group_rule_or_a_single_message() {
        let (r, other, now) = (rule(10), rule(10), Instant::now());
        for next in [
            queued(Some(&r), "g", "b", now),     // another tenant
            queued(Some(&r), "h", "a", now),     // another group (colliding lane key)
            queued(Some(&other), "g", "a", now), // another handler's rule
            queued(None, "g", "a", now),         // a single message
        ] {
            let mut l = lane(vec![queued(Some(&r), "g", "a", now), next]);
            assert_eq!(
                taken(take_batch(&mut l, &r, now, false)),
                (1, Some(FlushReason::Boundary))
            );
            assert_eq!(l.queue.len(), 1);
        }
    }

    #[test]
    fn a_partial_batch_waits_until_its_oldest_member_has_lingered() {
        let (r, start) = (rule(10), Instant::now());
        let mut l = lane(vec![
            queued(Some(&r), "g", "a", start),
            queued(Some(&r), "g", "a", start + Duration::from_millis(15)),
        ]);
        match take_batch(&mut l, &r, start + Duration::from_millis(19), false) {
            Take::Wait(until) => assert_eq!(until, start + r.linger),
            Take::Batch(..) => panic!("ran before the linger"),
        }
        assert_eq!(
            taken(take_batch(&mut l, &r, start + r.linger, false)),
            (2, Some(FlushReason::Linger))
        );
    }

    #[test]
    fn a_partial_batch_runs_at_once_when_the_window_is_full() {
        let (r, now) = (rule(10), Instant::now());
        let mut l = lane(vec![queued(Some(&r), "g", "a", now), queued(Some(&r), "g", "a", now)]);
        assert_eq!(taken(take_batch(&mut l, &r, now, true)), (2, Some(FlushReason::Window)));
        // A full batch is still a full batch.
        let mut l = lane((0..10).map(|_| queued(Some(&r), "g", "a", now)).collect());
        assert_eq!(taken(take_batch(&mut l, &r, now, true)), (10, Some(FlushReason::Size)));
    }
}
