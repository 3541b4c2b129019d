// The emulator's conformance scenarios through the JavaScript SDK (@azure/service-bus, pinned in package.json).
// tests/sdks/test_js_sdk.py creates the queues, starts this script once and reads one JSON line per scenario:
//   {"scenario": name, "ok": bool, "detail": text, "ms": duration}
// Input (environment):
//   SB_CONNECTION_STRING  the namespace's connection string (UseDevelopmentEmulator=true)
//   SB_ADMIN_PORT         the namespace's admin HTTP port (for ServiceBusAdministrationClient)
//   SB_ENTITIES           JSON: {"queue": name, ...} one plain queue per scenario, "session"/"fields" session queues,
//                         "prefix": a unique prefix for the entities the admin client creates here
//   SB_SCENARIOS          optional, comma-separated: run only these
//   SB_WEBSOCKET          optional, JSON {"endpoint": "sb://localhost:PORT", "ca_file": path, "proxy": url}: every
//                         client speaks AMQP over WebSockets (the ws package) to the emulator's wss port, trusting
//                         its CA, through the HTTP proxy when one is named (tests/sdks/test_js_sdk_websockets.py)
import { readFileSync } from "node:fs";
import { ServiceBusAdministrationClient, ServiceBusClient, isServiceBusError } from "@azure/service-bus";

const connectionString = process.env.SB_CONNECTION_STRING;
const adminPort = process.env.SB_ADMIN_PORT;
const entities = JSON.parse(process.env.SB_ENTITIES || "{}");
const only = process.env.SB_SCENARIOS ? new Set(process.env.SB_SCENARIOS.split(",")) : null;
const SCENARIO_TIMEOUT_MS = 25000;
const transport = await webSocketTransport(process.env.SB_WEBSOCKET);

/** The ServiceBusClient options that carry AMQP over WebSockets (none without SB_WEBSOCKET). */
async function webSocketTransport(spec) {
  if (!spec) return {};
  const { endpoint, ca_file: caFile, proxy } = JSON.parse(spec);
  const { default: WebSocket } = await import("ws");
  const ca = readFileSync(caFile);
  const socketOptions = { ca };
  if (proxy) {
    const { HttpsProxyAgent } = await import("https-proxy-agent");
    socketOptions.agent = new HttpsProxyAgent(proxy, { ca });
  }
  return {
    customEndpointAddress: endpoint,
    webSocketOptions: { webSocket: WebSocket, webSocketConstructorOptions: socketOptions },
  };
}

class Failed extends Error {}

function check(condition, what) {
  if (!condition) throw new Failed(what);
}

function equal(actual, expected, what) {
  const a = JSON.stringify(actual);
  const e = JSON.stringify(expected);
  if (a !== e) throw new Failed(`${what}: expected ${e}, got ${a}`);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Receive until `count` messages came or `waitMs` passed. */
async function receive(receiver, count, waitMs = 5000) {
  const got = [];
  const deadline = Date.now() + waitMs;
  while (got.length < count && Date.now() < deadline) {
    const batch = await receiver.receiveMessages(count - got.length, {
      maxWaitTimeInMs: Math.max(200, Math.min(2000, deadline - Date.now())),
    });
    got.push(...batch);
  }
  return got;
}

const bodies = (messages) => messages.map((m) => m.body);
const seq = (message) => message.sequenceNumber.toNumber();

/** The admin client on the emulator's admin port: the SDK always builds https URLs; the emulator serves http. */
function adminClient() {
  const cs = connectionString.replace(/:\d+;/, `:${adminPort};`);
  const admin = new ServiceBusAdministrationClient(cs);
  admin.pipeline.addPolicy({
    name: "emulatorPlainHttp",
    sendRequest: (request, next) => {
      request.url = request.url.replace(/^https:/, "http:");
      request.allowInsecureConnection = true;
      return next(request);
    },
  });
  return admin;
}

const client = new ServiceBusClient(connectionString, {
  ...transport,
  retryOptions: { maxRetries: 0, timeoutInMs: 20000 },
});

const scenarios = {
  async message_fields() {
    const queue = entities.fields; // a session queue: sessionId and replyToSessionId travel too
    const scheduled = new Date(Date.now() + 1500);
    scheduled.setMilliseconds(0);
    const when = new Date(Date.UTC(2024, 0, 2, 3, 4, 5));
    const sent = {
      body: { text: "every field", n: 1, nested: [1, "two", true] },
      messageId: "fields-1",
      correlationId: "corr-1",
      subject: "subject-1",
      to: "to-1",
      replyTo: "reply-queue",
      replyToSessionId: "reply-session",
      contentType: "application/json",
      timeToLive: 600000,
      sessionId: "s-fields",
      partitionKey: "s-fields",
      scheduledEnqueueTimeUtc: scheduled,
      applicationProperties: { s: "text", i: 42, d: 2.5, b: true, neg: -7, t: when },
    };
    const sender = client.createSender(queue);
    const before = Date.now();
    await sender.sendMessages(sent);
    await sender.close();
    const receiver = await client.acceptSession(queue, "s-fields");
    const [m] = await receive(receiver, 1, 8000);
    check(m, "the message did not arrive");
    for (const key of ["messageId", "correlationId", "subject", "to", "replyTo", "replyToSessionId", "contentType",
      "timeToLive", "sessionId", "partitionKey"]) {
      equal(m[key], sent[key], key);
    }
    equal(m.body, sent.body, "body");
    // a Date comes back as its epoch milliseconds: the SDK converts timestamps unless told not to
    equal(m.applicationProperties, { ...sent.applicationProperties, t: when.getTime() }, "applicationProperties");
    equal(m.scheduledEnqueueTimeUtc?.toISOString(), scheduled.toISOString(), "scheduledEnqueueTimeUtc");
    check(m.enqueuedTimeUtc instanceof Date && m.enqueuedTimeUtc.getTime() >= scheduled.getTime() - 50,
      `enqueuedTimeUtc ${m.enqueuedTimeUtc?.toISOString()} is before the scheduled time ${scheduled.toISOString()}`);
    check(m.enqueuedTimeUtc.getTime() >= before - 2000, "enqueuedTimeUtc is before the send");
    check(m.sequenceNumber && seq(m) >= 1, `sequenceNumber ${m.sequenceNumber}`);
    equal(m.deliveryCount, 0, "deliveryCount");
    check(m.lockedUntilUtc instanceof Date && m.lockedUntilUtc.getTime() > Date.now(),
      `lockedUntilUtc ${m.lockedUntilUtc?.toISOString()} is not in the future`);
    check(typeof m.lockToken === "string" && m.lockToken.length === 36, `lockToken ${m.lockToken}`);
    equal(m.state, "active", "state");
    check(m.expiresAtUtc?.getTime() === m.enqueuedTimeUtc.getTime() + sent.timeToLive,
      `expiresAtUtc ${m.expiresAtUtc?.toISOString()} is not enqueuedTimeUtc + timeToLive`);
    await receiver.completeMessage(m);
    await receiver.close();
    return `sequenceNumber ${seq(m)}, enqueued ${m.enqueuedTimeUtc.toISOString()}`;
  },

  async message_without_id() {
    const sender = client.createSender(entities.without_id);
    await sender.sendMessages({ body: "no id" });
    await sender.close();
    const receiver = client.createReceiver(entities.without_id);
    const [m] = await receive(receiver, 1);
    check(m, "the message did not arrive");
    check(typeof m.messageId === "string" && m.messageId.length > 0, `messageId ${m.messageId}`);
    await receiver.completeMessage(m); // the SDK's lock renewer is keyed on the id: it threw here without one
    await receiver.close();
    return `messageId ${m.messageId}`;
  },

  async batch() {
    const sender = client.createSender(entities.batch);
    const batch = await sender.createMessageBatch();
    for (let i = 0; i < 20; i++) {
      check(batch.tryAddMessage({ body: `b${i}`, messageId: `b${i}`, applicationProperties: { i } }),
        `tryAddMessage refused message ${i}`);
    }
    equal(batch.count, 20, "batch.count");
    await sender.sendMessages(batch);
    await sender.sendMessages([{ body: "array-0" }, { body: "array-1" }]);
    await sender.close();
    const receiver = client.createReceiver(entities.batch, { receiveMode: "receiveAndDelete" });
    const got = await receive(receiver, 22);
    await receiver.close();
    equal(bodies(got), [...Array.from({ length: 20 }, (_, i) => `b${i}`), "array-0", "array-1"], "bodies in order");
    equal(got.map((m) => m.applicationProperties?.i).slice(0, 20), Array.from({ length: 20 }, (_, i) => i),
      "applicationProperties");
    return `${got.length} messages, sequence numbers ${seq(got[0])}..${seq(got[got.length - 1])}`;
  },

  async peek() {
    const sender = client.createSender(entities.peek);
    await sender.sendMessages([0, 1, 2, 3].map((i) => ({ body: `p${i}` })));
    await sender.close();
    const receiver = client.createReceiver(entities.peek);
    const first = await receiver.peekMessages(2);
    equal(bodies(first), ["p0", "p1"], "peekMessages(2)");
    const rest = await receiver.peekMessages(10); // continues after the last peeked message
    equal(bodies(rest), ["p2", "p3"], "the next peekMessages");
    const from = await receiver.peekMessages(10, { fromSequenceNumber: first[1].sequenceNumber });
    equal(bodies(from), ["p1", "p2", "p3"], "peekMessages fromSequenceNumber");
    check(first.every((m) => m.lockToken === undefined), "peeked messages carry a lock token");
    const got = await receive(receiver, 4); // peeking locked nothing
    equal(bodies(got), ["p0", "p1", "p2", "p3"], "received after peeking");
    for (const m of got) await receiver.completeMessage(m);
    equal(bodies(await receiver.peekMessages(10, { fromSequenceNumber: first[0].sequenceNumber })), [],
      "peek after completing all");
    await receiver.close();
    return "peeked 2 + 2, from a sequence number 3, then received 4";
  },

  async defer() {
    const sender = client.createSender(entities.defer);
    await sender.sendMessages([{ body: "deferred" }, { body: "next" }]);
    await sender.close();
    const receiver = client.createReceiver(entities.defer);
    const [m] = await receive(receiver, 1);
    equal(m?.body, "deferred", "first message");
    await receiver.deferMessage(m);
    const [next] = await receive(receiver, 1);
    equal(next?.body, "next", "the deferred message is not received again");
    await receiver.completeMessage(next);
    const [peeked] = await receiver.peekMessages(1, { fromSequenceNumber: m.sequenceNumber });
    equal(peeked?.state, "deferred", "peeked state");
    const [again] = await receiver.receiveDeferredMessages(m.sequenceNumber);
    equal(again?.body, "deferred", "receiveDeferredMessages");
    equal(seq(again), seq(m), "sequence number");
    await receiver.completeMessage(again);
    equal(await receiver.peekMessages(5, { fromSequenceNumber: m.sequenceNumber }), [], "queue empty after complete");
    let missing;
    try {
      await receiver.receiveDeferredMessages(m.sequenceNumber); // completed: no longer there
    } catch (err) {
      missing = err;
    }
    equal(missing?.code, "MessageNotFound", "receiveDeferredMessages of a completed message");
    await receiver.close();
    return `deferred #${seq(m)} received by sequence number and completed; again: ${missing.code}`;
  },

  async dead_letter() {
    const sender = client.createSender(entities.dead_letter);
    await sender.sendMessages({ body: "poison", messageId: "dl-1" });
    await sender.close();
    const receiver = client.createReceiver(entities.dead_letter);
    const [m] = await receive(receiver, 1);
    check(m, "the message did not arrive");
    await receiver.deadLetterMessage(m, { deadLetterReason: "BadInput", deadLetterErrorDescription: "not a number" });
    await receiver.close();
    const dlq = client.createReceiver(entities.dead_letter, { subQueueType: "deadLetter" });
    const [d] = await receive(dlq, 1);
    check(d, "nothing in the dead-letter sub-queue");
    equal([d.body, d.messageId], ["poison", "dl-1"], "dead-lettered message");
    equal(d.deadLetterReason, "BadInput", "deadLetterReason");
    equal(d.deadLetterErrorDescription, "not a number", "deadLetterErrorDescription");
    equal(d.state, "active", "state");
    await dlq.completeMessage(d);
    await dlq.close();
    return `reason ${d.deadLetterReason}, description ${d.deadLetterErrorDescription}`;
  },

  async abandon() {
    const sender = client.createSender(entities.abandon);
    await sender.sendMessages({ body: "again" });
    await sender.close();
    const receiver = client.createReceiver(entities.abandon);
    const counts = [];
    const props = [];
    for (let i = 0; i < 3; i++) {
      const [m] = await receive(receiver, 1);
      check(m, `delivery ${i + 1} did not arrive`);
      counts.push(m.deliveryCount);
      props.push(m.applicationProperties?.reason ?? null);
      if (i < 2) await receiver.abandonMessage(m, { reason: `try ${i}` });
      else await receiver.completeMessage(m);
    }
    await receiver.close();
    equal(counts, [0, 1, 2], "deliveryCount after each abandon");
    equal(props, [null, "try 0", "try 1"], "the properties abandonMessage modified");
    return `deliveryCount ${counts.join(", ")}`;
  },

  async max_delivery() {
    const admin = adminClient();
    const queue = `${entities.prefix}-max-delivery`;
    await admin.createQueue(queue, { maxDeliveryCount: 2 });
    const sender = client.createSender(queue);
    await sender.sendMessages({ body: "hopeless" });
    await sender.close();
    const receiver = client.createReceiver(queue);
    for (let i = 0; i < 2; i++) {
      const [m] = await receive(receiver, 1);
      check(m, `delivery ${i + 1} did not arrive`);
      await receiver.abandonMessage(m);
    }
    equal(await receiver.receiveMessages(1, { maxWaitTimeInMs: 300 }), [], "a third delivery");
    await receiver.close();
    const dlq = client.createReceiver(queue, { subQueueType: "deadLetter", receiveMode: "receiveAndDelete" });
    const [dead] = await receive(dlq, 1);
    await dlq.close();
    equal([dead?.body, dead?.deadLetterReason], ["hopeless", "MaxDeliveryCountExceeded"], "dead-lettered");
    await admin.deleteQueue(queue);
    return `dead-lettered after 2 deliveries: ${dead.deadLetterReason}: ${dead.deadLetterErrorDescription}`;
  },

  async receive_and_delete() {
    const sender = client.createSender(entities.receive_and_delete);
    await sender.sendMessages([{ body: "gone-0" }, { body: "gone-1" }]);
    await sender.close();
    const receiver = client.createReceiver(entities.receive_and_delete, { receiveMode: "receiveAndDelete" });
    const got = await receive(receiver, 2);
    equal(bodies(got), ["gone-0", "gone-1"], "received");
    check(got.every((m) => m.lockToken === undefined), "a receiveAndDelete message carries a lock token");
    equal(await receiver.peekMessages(5), [], "peek after receiveAndDelete");
    await receiver.close();
    return "2 messages received and deleted";
  },

  async schedule() {
    const sender = client.createSender(entities.schedule);
    const at = new Date(Date.now() + 2500);
    const seqs = await sender.scheduleMessages([{ body: "kept" }, { body: "cancelled" }], at);
    equal(seqs.length, 2, "sequence numbers returned");
    const receiver = client.createReceiver(entities.schedule);
    const peeked = await receiver.peekMessages(5);
    equal(peeked.map((m) => [m.body, m.state]), [["kept", "scheduled"], ["cancelled", "scheduled"]], "peeked");
    equal(peeked.map(seq), seqs.map((s) => s.toNumber()), "peeked sequence numbers");
    await sender.cancelScheduledMessages(seqs[1]);
    if (at.getTime() - Date.now() > 800) {
      equal(await receiver.receiveMessages(1, { maxWaitTimeInMs: 500 }), [], "a message before its time");
    }
    const got = await receive(receiver, 1, 5000);
    got.push(...(await receiver.receiveMessages(1, { maxWaitTimeInMs: 300 })));
    equal(bodies(got), ["kept"], "received after the scheduled time");
    check(got[0].enqueuedTimeUtc.getTime() >= at.getTime() - 50, "enqueued before its scheduled time");
    await receiver.completeMessage(got[0]);
    await receiver.close();
    await sender.close();
    return `scheduled #${seqs.map((s) => s.toNumber()).join(", #")}, cancelled the second`;
  },

  async sessions() {
    const queue = entities.session;
    const sender = client.createSender(queue);
    await sender.sendMessages([
      { body: "a1", sessionId: "a" }, { body: "b1", sessionId: "b" }, { body: "a2", sessionId: "a" },
    ]);
    await sender.close();
    const a = await client.acceptSession(queue, "a");
    equal(a.sessionId, "a", "sessionId");
    check(a.sessionLockedUntilUtc instanceof Date && a.sessionLockedUntilUtc.getTime() > Date.now(),
      `sessionLockedUntilUtc ${a.sessionLockedUntilUtc}`);
    let locked;
    try {
      await client.acceptSession(queue, "a"); // a second receiver for a session already locked
    } catch (err) {
      locked = err;
    }
    equal(locked?.code, "SessionCannotBeLocked", "acceptSession of a locked session");
    equal(bodies(await a.peekMessages(5)), ["a1", "a2"], "peek in session a");
    const gotA = await receive(a, 2);
    equal(bodies(gotA), ["a1", "a2"], "session a");
    for (const m of gotA) await a.completeMessage(m);
    const initial = await a.getSessionState();
    check(initial == null, `state before setSessionState: ${initial}`);
    await a.setSessionState({ step: 2, items: ["x"] }); // the SDK stores an object as JSON
    equal(await a.getSessionState(), { step: 2, items: ["x"] }, "getSessionState");
    await a.close();
    const next = await client.acceptNextSession(queue);
    equal(next.sessionId, "b", "acceptNextSession");
    const gotB = await receive(next, 1);
    equal(bodies(gotB), ["b1"], "session b");
    await next.completeMessage(gotB[0]);
    await next.close();
    const again = await client.acceptSession(queue, "a");
    equal(await again.getSessionState(), { step: 2, items: ["x"] }, "state kept after the receiver closed");
    await again.close();
    // no session has messages: no session is handed out (the SDK sends no com.microsoft:timeout and gives up after
    // its own operation timeout, here 1.5 s)
    const impatient = new ServiceBusClient(connectionString, {
      ...transport,
      retryOptions: { maxRetries: 0, timeoutInMs: 1500 },
    });
    let error;
    try {
      const handed = await impatient.acceptNextSession(queue, { maxAutoLockRenewalDurationInMs: 0 });
      error = `session ${handed.sessionId} was handed out`;
    } catch (err) {
      error = err;
    }
    await impatient.close();
    check(isServiceBusError(error), `acceptNextSession on an empty queue: ${describe(error)}`);
    return `a: ${bodies(gotA)}, state kept; locked twice: ${locked.code}; next available: b; empty queue: ${error.code}`;
  },

  async topic_filters() {
    const admin = adminClient();
    const topic = `${entities.prefix}-topic`;
    await admin.createTopic(topic);
    await admin.createSubscription(topic, "red", {
      defaultRuleOptions: { name: "red", filter: { sqlExpression: "color = 'red' AND size > 2" } },
    });
    await admin.createSubscription(topic, "orders");
    await admin.createRule(topic, "orders", "by-correlation", { correlationId: "order", applicationProperties: { v: 2 } });
    await admin.deleteRule(topic, "orders", "$Default");
    await admin.createSubscription(topic, "all");
    const rules = [];
    for await (const rule of admin.listRules(topic, "orders")) rules.push(rule.name);
    equal(rules, ["by-correlation"], "listRules");
    const subs = [];
    for await (const sub of admin.listSubscriptions(topic)) subs.push(sub.subscriptionName);
    equal(subs.sort(), ["all", "orders", "red"], "listSubscriptions");
    const sender = client.createSender(topic);
    await sender.sendMessages([
      { body: "red-big", applicationProperties: { color: "red", size: 5 } },
      { body: "red-small", applicationProperties: { color: "red", size: 1 } },
      { body: "order-v2", correlationId: "order", applicationProperties: { v: 2 } },
      { body: "order-v1", correlationId: "order", applicationProperties: { v: 1 } },
    ]);
    await sender.close();
    const got = {};
    for (const [sub, n] of [["red", 1], ["orders", 1], ["all", 4]]) {
      const receiver = client.createReceiver(topic, sub, { receiveMode: "receiveAndDelete" });
      got[sub] = bodies(await receive(receiver, n, 4000));
      const extra = await receiver.receiveMessages(5, { maxWaitTimeInMs: 300 });
      got[sub].push(...bodies(extra));
      await receiver.close();
    }
    equal(got, { red: ["red-big"], orders: ["order-v2"], all: ["red-big", "red-small", "order-v2", "order-v1"] },
      "what each subscription received");
    const runtime = await admin.getSubscriptionRuntimeProperties(topic, "all");
    equal(runtime.activeMessageCount, 0, "activeMessageCount after receiving");
    await admin.deleteTopic(topic);
    return "SQL filter, correlation filter with a property, true filter; rules created by the admin client";
  },

  async duplicate_detection() {
    const admin = adminClient();
    const queue = `${entities.prefix}-dedupe`;
    const created = await admin.createQueue(queue, {
      requiresDuplicateDetection: true, duplicateDetectionHistoryTimeWindow: "PT1M",
    });
    equal([created.requiresDuplicateDetection, created.duplicateDetectionHistoryTimeWindow], [true, "PT1M"],
      "the created queue");
    const sender = client.createSender(queue);
    await sender.sendMessages({ body: "first", messageId: "same" });
    await sender.sendMessages({ body: "second", messageId: "same" });
    await sender.sendMessages({ body: "other", messageId: "other" });
    await sender.close();
    const receiver = client.createReceiver(queue, { receiveMode: "receiveAndDelete" });
    const got = await receive(receiver, 2);
    got.push(...(await receiver.receiveMessages(1, { maxWaitTimeInMs: 300 })));
    await receiver.close();
    equal(bodies(got), ["first", "other"], "received");
    await admin.deleteQueue(queue);
    return "the repeated messageId was dropped";
  },

  async lock_renewal() {
    const sender = client.createSender(entities.lock_renewal);
    await sender.sendMessages({ body: "renew me" });
    await sender.close();
    const receiver = client.createReceiver(entities.lock_renewal, { maxAutoLockRenewalDurationInMs: 0 });
    const [m] = await receive(receiver, 1);
    check(m, "the message did not arrive");
    const before = m.lockedUntilUtc.getTime();
    check(Math.abs(before - Date.now() - 60000) < 10000, `lockedUntilUtc is ${before - Date.now()} ms away, not the 60 s lock`);
    await sleep(1100);
    const renewed = await receiver.renewMessageLock(m);
    check(renewed instanceof Date && renewed.getTime() >= before + 1000,
      `renewMessageLock: ${renewed?.toISOString?.()} is not later than ${new Date(before).toISOString()}`);
    equal(m.lockedUntilUtc.getTime(), renewed.getTime(), "the message's lockedUntilUtc after renewal");
    await receiver.completeMessage(m);
    let lost;
    try {
      await receiver.renewMessageLock(m);
    } catch (err) {
      lost = err;
    }
    equal(lost?.code, "MessageLockLost", "renewMessageLock of a completed message");
    await receiver.close();
    const sessionSender = client.createSender(entities.session_lock);
    await sessionSender.sendMessages({ body: "s", sessionId: "renewed" });
    await sessionSender.close();
    const session = await client.acceptSession(entities.session_lock, "renewed", { maxAutoLockRenewalDurationInMs: 0 });
    const sessionBefore = session.sessionLockedUntilUtc.getTime();
    await sleep(1100);
    const sessionRenewed = await session.renewSessionLock();
    check(sessionRenewed.getTime() >= sessionBefore + 1000,
      `renewSessionLock: ${sessionRenewed.toISOString()} is not later than ${new Date(sessionBefore).toISOString()}`);
    equal(session.sessionLockedUntilUtc.getTime(), sessionRenewed.getTime(), "sessionLockedUntilUtc after renewal");
    await session.close();
    return `message lock +${renewed.getTime() - before} ms, session lock +${sessionRenewed.getTime() - sessionBefore} ms`;
  },

  async size_limit() {
    const sender = client.createSender(entities.size_limit);
    const big = { body: Buffer.alloc(300 * 1024, 1) };
    let error;
    try {
      await sender.sendMessages(big);
    } catch (err) {
      error = err;
    }
    check(error, "a 300 KiB message was sent");
    equal([error.name, error.code], ["ServiceBusError", "MessageSizeExceeded"], "the error");
    const batch = await sender.createMessageBatch();
    equal(batch.maxSizeInBytes, 256 * 1024, "the batch's maxSizeInBytes (the link's max-message-size)");
    check(!batch.tryAddMessage(big), "tryAddMessage took a 300 KiB message");
    let n = 0;
    while (batch.tryAddMessage({ body: Buffer.alloc(10 * 1024, 2) })) n++;
    await sender.sendMessages(batch); // a batch the SDK filled to its limit is accepted
    const fits = Buffer.alloc(250 * 1024, 3);
    await sender.sendMessages({ body: fits });
    await sender.close();
    const receiver = client.createReceiver(entities.size_limit, { receiveMode: "receiveAndDelete" });
    const got = await receive(receiver, n + 1, 6000);
    await receiver.close();
    equal(got.length, n + 1, "messages received");
    check(Buffer.from(got[n].body).equals(fits), "the 250 KiB body came back changed");
    return `refused: ${error.code}; a batch of ${n} x 10 KiB and a 250 KiB message accepted`;
  },

  async subscribe() {
    const sender = client.createSender(entities.subscribe);
    await sender.sendMessages([0, 1, 2].map((i) => ({ body: `sub-${i}` })));
    await sender.close();
    const receiver = client.createReceiver(entities.subscribe);
    const got = [];
    const errors = [];
    let done;
    const all = new Promise((resolve) => (done = resolve));
    const subscription = receiver.subscribe({
      processMessage: async (m) => {
        got.push(m.body);
        if (got.length === 3) done();
      },
      processError: async (args) => {
        errors.push(`${args.errorSource}: ${args.error.message}`);
      },
    });
    await Promise.race([all, sleep(8000)]);
    await subscription.close();
    await sleep(200); // the automatic completions settle
    equal(got, ["sub-0", "sub-1", "sub-2"], "processMessage got");
    equal(errors, [], "processError got");
    equal(await receiver.peekMessages(5), [], "peek after the automatic completion");
    await receiver.close();
    return "3 messages through processMessage, completed automatically";
  },

  async session_subscribe() {
    const sender = client.createSender(entities.session_subscribe);
    await sender.sendMessages([0, 1, 2].map((i) => ({ body: `ss-${i}`, sessionId: "streamed" })));
    await sender.close();
    const receiver = await client.acceptNextSession(entities.session_subscribe);
    equal(receiver.sessionId, "streamed", "acceptNextSession");
    const got = [];
    const errors = [];
    let done;
    const all = new Promise((resolve) => (done = resolve));
    const subscription = receiver.subscribe({
      processMessage: async (m) => {
        got.push(m.body);
        if (got.length === 3) done();
      },
      processError: async (args) => {
        errors.push(`${args.errorSource}: ${args.error.message}`);
      },
    });
    await Promise.race([all, sleep(8000)]);
    await subscription.close();
    await sleep(200); // the automatic completions settle
    equal(got, ["ss-0", "ss-1", "ss-2"], "processMessage got, in order");
    equal(errors, [], "processError got");
    equal(await receiver.peekMessages(5), [], "peek after the automatic completion");
    await receiver.close();
    return "a session's 3 messages through processMessage, in order, completed automatically";
  },

  async rule_manager() {
    // the rule manager works over the subscription's $management node (add-rule, enumerate-rules, remove-rule)
    const admin = adminClient();
    const topic = `${entities.prefix}-rules`;
    await admin.createTopic(topic);
    await admin.createSubscription(topic, "managed");
    const rules = client.createRuleManager(topic, "managed");
    await rules.createRule("blue", { sqlExpression: "color = 'blue'" }, { sqlExpression: "SET seen = 'yes'" });
    await rules.createRule("urgent", { subject: "urgent", applicationProperties: { level: 3 } });
    await rules.deleteRule("$Default");
    const listed = [];
    for await (const rule of rules.listRules()) listed.push([rule.name, rule.filter.sqlExpression ?? rule.filter.subject]);
    equal(listed.sort(), [["blue", "color = 'blue'"], ["urgent", "urgent"]], "listRules");
    let duplicate;
    try {
      await rules.createRule("blue", { sqlExpression: "1 = 1" });
    } catch (err) {
      duplicate = err;
    }
    check(duplicate, "a second rule named blue was created");
    const sender = client.createSender(topic);
    await sender.sendMessages([
      { body: "blue", applicationProperties: { color: "blue" } },
      { body: "red", applicationProperties: { color: "red" } },
      { body: "urgent", subject: "urgent", applicationProperties: { level: 3 } },
    ]);
    await sender.close();
    const receiver = client.createReceiver(topic, "managed", { receiveMode: "receiveAndDelete" });
    const got = await receive(receiver, 2);
    got.push(...(await receiver.receiveMessages(1, { maxWaitTimeInMs: 300 })));
    await receiver.close();
    equal(bodies(got), ["blue", "urgent"], "routed by the managed rules");
    equal(got[0].applicationProperties.seen, "yes", "the SQL action's SET");
    await admin.deleteTopic(topic);
    return `rules ${listed.map((r) => r[0]).join(", ")}; a duplicate name refused: ${duplicate.code ?? duplicate.name}`;
  },

  async expiry() {
    // a message past its time to live is not delivered; the queue dead-letters it (deadLetteringOnMessageExpiration)
    const admin = adminClient();
    const queue = `${entities.prefix}-expiry`;
    await admin.createQueue(queue, { deadLetteringOnMessageExpiration: true });
    const sender = client.createSender(queue);
    await sender.sendMessages([{ body: "short", timeToLive: 500 }, { body: "long", timeToLive: 60000 }]);
    await sender.close();
    await sleep(900);
    const receiver = client.createReceiver(queue, { receiveMode: "receiveAndDelete" });
    const got = await receive(receiver, 1);
    got.push(...(await receiver.receiveMessages(1, { maxWaitTimeInMs: 300 })));
    await receiver.close();
    equal(bodies(got), ["long"], "received");
    const dlq = client.createReceiver(queue, { subQueueType: "deadLetter", receiveMode: "receiveAndDelete" });
    const [dead] = await receive(dlq, 1);
    await dlq.close();
    equal(dead?.body, "short", "dead-lettered on expiry");
    equal(dead.deadLetterReason, "TTLExpiredException", "deadLetterReason");
    await admin.deleteQueue(queue);
    return `expired message dead-lettered: ${dead.deadLetterReason}`;
  },

  async lock_lost() {
    // a message whose lock expired can no longer be settled by its receiver
    const admin = adminClient();
    const queue = `${entities.prefix}-lock-lost`;
    await admin.createQueue(queue, { lockDuration: "PT5S" }); // the service's shortest lock
    const sender = client.createSender(queue);
    await sender.sendMessages([{ body: "renewed" }, { body: "slow" }]);
    await sender.close();
    // one receiver renews its locks itself (the SDK's default), one does not
    const renewing = client.createReceiver(queue, { maxAutoLockRenewalDurationInMs: 60000 });
    const [kept] = await receive(renewing, 1);
    equal(kept?.body, "renewed", "the renewing receiver's message");
    const receiver = client.createReceiver(queue, { maxAutoLockRenewalDurationInMs: 0 });
    const [m] = await receive(receiver, 1);
    equal(m?.body, "slow", "the other receiver's message");
    await sleep(5500);
    await renewing.completeMessage(kept); // its lock was renewed in the background
    await renewing.close();
    let error;
    try {
      await receiver.completeMessage(m);
    } catch (err) {
      error = err;
    }
    equal(error?.code, "MessageLockLost", "completing after the lock expired");
    const [again] = await receive(receiver, 1);
    equal([again?.body, again?.deliveryCount], ["slow", 1], "redelivered");
    await receiver.completeMessage(again);
    await receiver.close();
    await admin.deleteQueue(queue);
    return `automatic renewal kept one lock past 5 s; the other: ${error.code}, then redelivered with deliveryCount 1`;
  },

  async body_types() {
    // AMQP bodies other than one data section: a value and a sequence, sent as AmqpAnnotatedMessage
    const sender = client.createSender(entities.body_types);
    await sender.sendMessages([
      { body: { a: [1, 2] }, bodyType: "value", header: { priority: 7 }, messageAnnotations: { note: "x" } },
      { body: [["one", 2], [true]], bodyType: "sequence" },
      { body: Buffer.from([0, 1, 2]), bodyType: "data" },
    ]);
    await sender.close();
    const receiver = client.createReceiver(entities.body_types, { receiveMode: "receiveAndDelete" });
    const got = await receive(receiver, 3);
    await receiver.close();
    const raw = got.map((m) => m._rawAmqpMessage); // the SDK's documented raw AMQP view
    equal(raw.map((r) => r.bodyType), ["value", "sequence", "data"], "bodyType");
    equal(got[0].body, { a: [1, 2] }, "value body");
    equal(got[1].body, [["one", 2], [true]], "sequence body");
    equal([...got[2].body], [0, 1, 2], "data body");
    equal([raw[0].header?.priority, raw[0].messageAnnotations?.note], [7, "x"], "header and annotations");
    return "value, sequence and data bodies kept with their header and annotations";
  },

  async iterator() {
    const sender = client.createSender(entities.iterator);
    await sender.sendMessages([0, 1, 2].map((i) => ({ body: `it-${i}` })));
    await sender.close();
    const receiver = client.createReceiver(entities.iterator);
    const got = [];
    for await (const m of receiver.getMessageIterator()) {
      got.push(m.body);
      await receiver.completeMessage(m);
      if (got.length === 3) break;
    }
    await receiver.close();
    equal(got, ["it-0", "it-1", "it-2"], "getMessageIterator");
    return "3 messages through getMessageIterator";
  },

  async not_found() {
    const sender = client.createSender(`${entities.prefix}-no-such-queue`);
    let error;
    try {
      await sender.sendMessages({ body: "x" });
    } catch (err) {
      error = err;
    }
    await sender.close();
    equal(error?.code, "MessagingEntityNotFound", "the error code");
    return `${error.code}: ${error.message.split(".")[0]}`;
  },

  async close() {
    // a client of its own that used a sender, a receiver and a session, as an application does at shutdown
    const own = new ServiceBusClient(connectionString, transport);
    const sender = own.createSender(entities.close);
    await sender.sendMessages({ body: "last" });
    const receiver = own.createReceiver(entities.close);
    const [m] = await receive(receiver, 1);
    check(m, "the message did not arrive");
    await receiver.completeMessage(m);
    const start = Date.now();
    await own.close();
    const ms = Date.now() - start;
    check(ms < 5000, `ServiceBusClient.close() took ${ms} ms`);
    return `ServiceBusClient.close() took ${ms} ms`;
  },

  async python_fast_path() {
    // messages the Python sink sent with its fast encoder (spark_sb.wire) and with the SDK's (sink.encoder: sdk),
    // made by tests/sdks/fast_path.py: every field, each application property's value and JavaScript type as the
    // row gave them, and the same through both encoders
    const spec = JSON.parse(process.env.SB_FAST_PATH || "null");
    check(spec, "SB_FAST_PATH is not set");
    // a new object for each receiver: the SDK changes the options it is given (a second receiver given the same
    // object peek-locked its messages)
    const options = () => ({ receiveMode: "receiveAndDelete", skipParsingBodyAsJson: true, skipConvertingDate: true });
    let messages = 0;
    let properties = 0;
    for (const session of [false, true]) {
      const rows = spec.messages.filter((row) => row.session === session);
      const ids = rows.map((row) => row.message_id);
      const got = {};
      for (const encoder of ["fast", "sdk"]) {
        const queue = spec.queues[session ? `${encoder}_session` : encoder];
        const receiver = session ? await client.acceptSession(queue, spec.session_id, options())
          : client.createReceiver(queue, options());
        got[encoder] = await receive(receiver, ids.length, 8000);
        got[encoder].push(...(await receiver.receiveMessages(1, { maxWaitTimeInMs: 300 })));
        await receiver.close();
        equal(got[encoder].map((m) => m.messageId), ids, `the message ids in ${queue} (${encoder} encoder), in order`);
      }
      rows.forEach((row, i) => {
        const id = row.message_id;
        const fast = fieldsOf(got.fast[i]);
        const sdk = fieldsOf(got.sdk[i]);
        for (const key of Object.keys(sdk)) {
          equal(fast[key], sdk[key], `${id}: ${key} sent by the fast encoder (against the SDK's)`);
        }
        equal(fast.body, row.body_b64, `${id}: body (base64)`);
        equal(fast.bodyType, "data", `${id}: body type`);
        const fields = { subject: "subject", contentType: "content_type", correlationId: "correlation_id", to: "to",
          replyTo: "reply_to", partitionKey: "partition_key", sessionId: "session_id" };
        for (const [key, field] of Object.entries(fields)) equal(fast[key] ?? null, row[field], `${id}: ${key}`);
        equal(fast.replyToSessionId, undefined, `${id}: replyToSessionId`);
        const received = got.fast[i].applicationProperties ?? {};
        equal(Object.keys(received).sort(), Object.keys(row.properties).sort(), `${id}: application property names`);
        for (const [name, [amqpType, text]] of Object.entries(row.properties)) {
          const what = `${id}: application property ${name} (${amqpType})`;
          const value = received[name];
          if (text === null) {
            equal(value, null, what);
            continue;
          }
          equal(typeName(value), JS_TYPES[amqpType], `${what}: its JavaScript type`);
          const expected = amqpType === "boolean" ? String(Number(text === "true")) : text;
          if (!["uuid", "decimal128"].includes(amqpType)) equal(canon(value), expected, `${what}: its value`);
          properties++;
        }
        messages++;
      });
    }
    return `${messages} messages (${properties} application property values) sent by the fast encoder: every ` +
      "field, each property's value and JavaScript type as the row gave them, and the same as the SDK encoder's";
  },
};

// --- python_fast_path: what the SDK makes of each AMQP type of application property (rhea's decoding) ---------

/** The JavaScript type each AMQP type of application property arrives as (with skipConvertingDate). A boolean
 * the Python SDK writes as 0x56 and a byte (both encoders: the fast one writes the SDK's bytes), which rhea reads as
 * the number 1 or 0 (it reads only 0x41 and 0x42, true and false, as booleans). */
const JS_TYPES = {
  string: "string", symbol: "string", binary: "Buffer", boolean: "number", byte: "number", short: "number",
  int: "number", long: "number", ubyte: "number", ushort: "number", uint: "number", ulong: "number",
  float: "number", double: "number", timestamp: "Date", uuid: "Buffer", decimal128: "Buffer",
};

function typeName(value) {
  if (value === null || value === undefined) return String(value);
  if (Buffer.isBuffer(value)) return "Buffer";
  if (value instanceof Date) return "Date";
  return typeof value === "object" ? value.constructor?.name ?? "object" : typeof value;
}

/** A property value as text: what the row held (a Date's milliseconds, a Buffer's base64). */
function canon(value) {
  if (Buffer.isBuffer(value)) return value.toString("base64");
  if (value instanceof Date) return String(value.getTime());
  return value === null || value === undefined ? value : String(value);
}

/** The message annotations the broker sets on a delivery (the lock's on a peek-locked one only), not the sender. */
const BROKER_ANNOTATIONS = ["x-opt-enqueued-time", "x-opt-sequence-number", "x-opt-enqueue-sequence-number",
  "x-opt-locked-until", "x-opt-lock-token", "x-opt-message-state"];

/** Everything the SDK tells of a received message but what the broker sets (times, sequence numbers, locks). */
function fieldsOf(m) {
  const raw = m._rawAmqpMessage;
  const props = {};
  for (const [name, value] of Object.entries(m.applicationProperties ?? {})) {
    props[name] = `${typeName(value)} ${canon(value)}`;
  }
  return {
    body: Buffer.isBuffer(m.body) ? m.body.toString("base64") : `not a Buffer: ${typeName(m.body)}`,
    bodyType: raw.bodyType,
    messageId: m.messageId, sessionId: m.sessionId, partitionKey: m.partitionKey, subject: m.subject,
    contentType: m.contentType, correlationId: m.correlationId, to: m.to, replyTo: m.replyTo,
    replyToSessionId: m.replyToSessionId, timeToLive: m.timeToLive,
    scheduledEnqueueTimeUtc: m.scheduledEnqueueTimeUtc?.toISOString(),
    header: raw.header ?? null,
    amqpProperties: Object.fromEntries(Object.entries(raw.properties ?? {}).filter(([, v]) => v !== undefined)
      .map(([k, v]) => [k, canon(v)])),
    annotationNames: Object.keys(raw.messageAnnotations ?? {}).filter((k) => !BROKER_ANNOTATIONS.includes(k)).sort(),
    applicationPropertyOrder: Object.keys(m.applicationProperties ?? {}),
    applicationProperties: props,
  };
}

function withTimeout(promise, ms, name) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Failed(`${name} did not finish within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function describe(err) {
  if (err instanceof Failed) return err.message;
  const code = err?.code ? ` [${err.code}]` : "";
  return `${err?.name ?? "Error"}${code}: ${err?.message ?? err}`;
}

for (const [name, run] of Object.entries(scenarios)) {
  if (only && !only.has(name)) continue;
  const start = Date.now();
  let result;
  try {
    const detail = await withTimeout(run(), SCENARIO_TIMEOUT_MS, name);
    result = { scenario: name, ok: true, detail: detail ?? "" };
  } catch (err) {
    result = { scenario: name, ok: false, detail: describe(err) };
  }
  result.ms = Date.now() - start;
  process.stdout.write(JSON.stringify(result) + "\n");
}
const closing = Date.now();
try {
  await withTimeout(client.close(), 10000, "the shared client's close");
  process.stdout.write(JSON.stringify({ scenario: "close_shared", ok: Date.now() - closing < 5000,
    detail: `the client every scenario used closed in ${Date.now() - closing} ms`, ms: Date.now() - closing }) + "\n");
} catch (err) {
  process.stdout.write(JSON.stringify({ scenario: "close_shared", ok: false, detail: describe(err),
    ms: Date.now() - closing }) + "\n");
}
process.exit(0);
