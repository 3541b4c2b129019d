package sparksb;

import com.azure.core.amqp.AmqpRetryMode;
import com.azure.core.amqp.AmqpRetryOptions;
import com.azure.core.amqp.models.AmqpMessageBody;
import com.azure.core.amqp.models.AmqpMessageBodyType;
import com.azure.core.exception.ResourceExistsException;
import com.azure.core.exception.ResourceNotFoundException;
import com.azure.core.http.HttpPipelinePosition;
import com.azure.core.http.policy.HttpPipelinePolicy;
import com.azure.core.util.BinaryData;
import com.azure.core.util.IterableStream;
import com.azure.messaging.servicebus.ServiceBusClientBuilder;
import com.azure.messaging.servicebus.ServiceBusErrorContext;
import com.azure.messaging.servicebus.ServiceBusException;
import com.azure.messaging.servicebus.ServiceBusFailureReason;
import com.azure.messaging.servicebus.ServiceBusMessage;
import com.azure.messaging.servicebus.ServiceBusMessageBatch;
import com.azure.messaging.servicebus.ServiceBusProcessorClient;
import com.azure.messaging.servicebus.ServiceBusReceivedMessage;
import com.azure.messaging.servicebus.ServiceBusReceivedMessageContext;
import com.azure.messaging.servicebus.ServiceBusReceiverAsyncClient;
import com.azure.messaging.servicebus.ServiceBusReceiverClient;
import com.azure.messaging.servicebus.ServiceBusRuleManagerClient;
import com.azure.messaging.servicebus.ServiceBusSenderAsyncClient;
import com.azure.messaging.servicebus.ServiceBusSenderClient;
import com.azure.messaging.servicebus.ServiceBusSessionReceiverClient;
import com.azure.messaging.servicebus.ServiceBusTransactionContext;
import com.azure.messaging.servicebus.administration.ServiceBusAdministrationClient;
import com.azure.messaging.servicebus.administration.ServiceBusAdministrationClientBuilder;
import com.azure.messaging.servicebus.administration.models.CorrelationRuleFilter;
import com.azure.messaging.servicebus.administration.models.CreateQueueOptions;
import com.azure.messaging.servicebus.administration.models.QueueProperties;
import com.azure.messaging.servicebus.administration.models.QueueRuntimeProperties;
import com.azure.messaging.servicebus.administration.models.CreateRuleOptions;
import com.azure.messaging.servicebus.administration.models.RuleProperties;
import com.azure.messaging.servicebus.administration.models.SqlRuleAction;
import com.azure.messaging.servicebus.administration.models.SqlRuleFilter;
import com.azure.messaging.servicebus.administration.models.TrueRuleFilter;
import com.azure.messaging.servicebus.models.AbandonOptions;
import com.azure.messaging.servicebus.models.DeadLetterOptions;
import com.azure.messaging.servicebus.models.DeferOptions;
import com.azure.messaging.servicebus.models.ServiceBusMessageState;
import com.azure.messaging.servicebus.models.ServiceBusReceiveMode;
import com.azure.messaging.servicebus.models.SubQueue;

import java.net.MalformedURLException;
import java.net.URL;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.stream.Collectors;

/**
 * Every scenario of the Java SDK against the spark-sb emulator, one JSON line each on stdout:
 * {"scenario": ..., "ok": true|false, "detail": ...}.
 *
 * <p>Environment: SB_CONNECTION_STRING (a UseDevelopmentEmulator=true connection string) and SB_ENTITY_PREFIX:
 * scenario {@code x_y} uses the entity {@code <prefix>x-y}, made beforehand by tests/sdks/test_java_sdk.py
 * (queues; a session queue for {@code sessions}; a topic with subscriptions sql, correlation and all for
 * {@code topic_filters}). Arguments, when given, name the scenarios to run (default: all).
 */
public final class Scenarios {
    /** A scenario's verdict: the check that failed, with what was seen. */
    static final class Failed extends RuntimeException {
        Failed(String message) {
            super(message);
        }
    }

    interface Scenario {
        String run() throws Exception;
    }

    private static final Duration WAIT = Duration.ofSeconds(10);
    private static final long SCENARIO_TIMEOUT_S = 60;

    private final String connectionString;
    private final String prefix;
    private final String adminEndpoint;

    Scenarios(String connectionString, String prefix, String adminEndpoint) {
        this.connectionString = connectionString;
        this.prefix = prefix;
        this.adminEndpoint = adminEndpoint;
    }

    public static void main(String[] args) throws Exception {
        String cs = System.getenv("SB_CONNECTION_STRING");
        String prefix = System.getenv("SB_ENTITY_PREFIX");
        if (cs == null || prefix == null) {
            System.err.println("SB_CONNECTION_STRING and SB_ENTITY_PREFIX must be set");
            System.exit(2);
        }
        Scenarios s = new Scenarios(cs, prefix, System.getenv("SB_ADMIN_ENDPOINT"));
        Map<String, Scenario> all = new LinkedHashMap<>();
        all.put("send_receive_fields", s::sendReceiveFields);
        all.put("body_types", s::bodyTypes);
        all.put("batch", s::batch);
        all.put("peek", s::peek);
        all.put("defer", s::defer);
        all.put("dead_letter", s::deadLetter);
        all.put("abandon", s::abandon);
        all.put("schedule", s::schedule);
        all.put("sessions", s::sessions);
        all.put("topic_filters", s::topicFilters);
        all.put("rule_manager", s::ruleManager);
        all.put("administration", s::administration);
        all.put("duplicate_detection", s::duplicateDetection);
        all.put("lock_renewal", s::lockRenewal);
        all.put("processor", s::processor);
        all.put("session_processor", s::sessionProcessor);
        all.put("receive_and_delete", s::receiveAndDelete);
        all.put("transactions_refused", s::transactionsRefused);
        all.put("async_clients", s::asyncClients);
        all.put("size_limit", s::sizeLimit);
        all.put("errors", s::errors);
        all.put("outage_recovery", s::outageRecovery);
        all.put("ttl_expiry", s::ttlExpiry);
        all.put("close", s::close);
        all.put("python_fast_path", s::pythonFastPath);
        List<String> names = args.length > 0 ? Arrays.asList(args) : new ArrayList<>(all.keySet());
        ExecutorService pool = Executors.newCachedThreadPool(r -> {
            Thread t = new Thread(r);
            t.setDaemon(true);
            return t;
        });
        for (String name : names) {
            Scenario scenario = all.get(name);
            if (scenario == null) {
                emit(name, false, "no such scenario");
                continue;
            }
            long started = System.nanoTime();
            Future<String> f = pool.submit(scenario::run);
            try {
                String detail = f.get(SCENARIO_TIMEOUT_S, TimeUnit.SECONDS);
                emit(name, true, detail + String.format(" (%.1f s)", (System.nanoTime() - started) / 1e9));
            } catch (TimeoutException e) {
                f.cancel(true);
                emit(name, false, "did not finish within " + SCENARIO_TIMEOUT_S + " s");
            } catch (java.util.concurrent.ExecutionException e) {
                emit(name, false, describe(e.getCause()));
            }
        }
        // daemon threads of the SDK (reactor, timers) must not keep the JVM alive
        System.out.flush();
        System.exit(0);
    }

    // ------------------------------------------------------------------ helpers

    private String entity(String scenario) {
        return prefix + scenario.replace('_', '-');
    }

    private ServiceBusClientBuilder builder() {
        // fail fast: one retry, a short try timeout (the default, 60 s and 3 retries, hides faults as hangs)
        return new ServiceBusClientBuilder()
            .connectionString(connectionString)
            .retryOptions(new AmqpRetryOptions().setMaxRetries(1).setTryTimeout(Duration.ofSeconds(15)));
    }

    private ServiceBusReceiverClient receiver(ServiceBusClientBuilder b, String queue) {
        return b.receiver().queueName(queue).receiveMode(ServiceBusReceiveMode.PEEK_LOCK).buildClient();
    }

    private static void check(boolean condition, String what, Object... args) {
        if (!condition) {
            throw new Failed(String.format(what, args));
        }
    }

    private static <T> void equal(T expected, T actual, String what) {
        if (expected == null ? actual != null : !expected.equals(actual)) {
            throw new Failed(what + ": expected " + expected + ", got " + actual);
        }
    }

    /** Receives until {@code n} messages came or {@code within} passed. */
    private static List<ServiceBusReceivedMessage> receive(ServiceBusReceiverClient r, int n, Duration within) {
        List<ServiceBusReceivedMessage> got = new ArrayList<>();
        long deadline = System.nanoTime() + within.toNanos();
        while (got.size() < n && System.nanoTime() < deadline) {
            Duration left = Duration.ofNanos(Math.max(deadline - System.nanoTime(), 1_000_000));
            IterableStream<ServiceBusReceivedMessage> batch
                = r.receiveMessages(n - got.size(), left.compareTo(Duration.ofSeconds(3)) > 0 ? Duration.ofSeconds(3) : left);
            batch.forEach(got::add);
        }
        return got;
    }

    /** Receives {@code n} messages (10 s at most), then whatever else comes within a second. */
    private static List<ServiceBusReceivedMessage> receiveExactly(ServiceBusReceiverClient r, int n) {
        List<ServiceBusReceivedMessage> got = receive(r, n, Duration.ofSeconds(10));
        got.addAll(receive(r, 1, Duration.ofSeconds(1)));
        return got;
    }

    private static List<String> bodies(List<ServiceBusReceivedMessage> messages) {
        return messages.stream().map(m -> m.getBody().toString()).collect(Collectors.toList());
    }

    private static List<ServiceBusMessage> texts(String... bodies) {
        return Arrays.stream(bodies).map(ServiceBusMessage::new).collect(Collectors.toList());
    }

    static String describe(Throwable e) {
        StringBuilder sb = new StringBuilder();
        for (Throwable t = e; t != null; t = t.getCause()) {
            if (sb.length() > 0) {
                sb.append(" <- ");
            }
            sb.append(t.getClass().getSimpleName()).append(": ").append(t.getMessage());
            if (t.getCause() == t) {
                break;
            }
        }
        if (!(e instanceof Failed)) {
            StackTraceElement[] trace = e.getStackTrace();
            for (StackTraceElement el : trace) {
                if (el.getClassName().startsWith("sparksb.")) {
                    sb.append(" at ").append(el);
                    break;
                }
            }
        }
        return sb.toString();
    }

    static void emit(String scenario, boolean ok, String detail) {
        System.out.println("{\"scenario\": " + json(scenario) + ", \"ok\": " + ok + ", \"detail\": " + json(detail) + "}");
        System.out.flush();
    }

    static String json(String s) {
        if (s == null) {
            return "null";
        }
        StringBuilder sb = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"': sb.append("\\\""); break;
                case '\\': sb.append("\\\\"); break;
                case '\n': sb.append("\\n"); break;
                case '\r': sb.append("\\r"); break;
                case '\t': sb.append("\\t"); break;
                default:
                    if (c < 0x20) {
                        sb.append(String.format("\\u%04x", (int) c));
                    } else {
                        sb.append(c);
                    }
            }
        }
        return sb.append('"').toString();
    }

    // ------------------------------------------------------------------ scenarios

    /** Every settable field survives the round trip; the broker's fields are set. */
    String sendReceiveFields() {
        String q = entity("send_receive_fields");
        ServiceBusClientBuilder b = builder();
        byte[] body = new byte[] {0, 1, 2, (byte) 0xff, (byte) 0xfe, 'x'};
        OffsetDateTime scheduled = OffsetDateTime.now(ZoneOffset.UTC).plusSeconds(2).withNano(0);
        ServiceBusMessage m = new ServiceBusMessage(BinaryData.fromBytes(body))
            .setMessageId("fields-1")
            .setCorrelationId("corr-1")
            .setSubject("subject-1")
            .setTo("to-1")
            .setReplyTo("reply-to-1")
            .setReplyToSessionId("reply-session-1")
            .setContentType("application/octet-stream")
            .setTimeToLive(Duration.ofMinutes(30))
            .setSessionId("session-1")
            .setPartitionKey("session-1")
            .setScheduledEnqueueTime(scheduled);
        Map<String, Object> props = new LinkedHashMap<>();
        props.put("string", "text é");
        props.put("int", 42);
        props.put("long", 1L << 40);
        props.put("double", 2.5d);
        props.put("boolean", true);
        props.put("short", (short) 7);
        props.put("uuid", java.util.UUID.fromString("0f8fad5b-d9cb-469f-a165-70867728950e"));
        m.getApplicationProperties().putAll(props);
        OffsetDateTime before = OffsetDateTime.now(ZoneOffset.UTC).minusSeconds(5);
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            s.sendMessage(m);
            List<ServiceBusReceivedMessage> got = receive(r, 1, Duration.ofSeconds(15));
            check(got.size() == 1, "received %d messages, expected 1", got.size());
            ServiceBusReceivedMessage g = got.get(0);
            check(Arrays.equals(body, g.getBody().toBytes()), "body %s", Arrays.toString(g.getBody().toBytes()));
            equal("fields-1", g.getMessageId(), "messageId");
            equal("corr-1", g.getCorrelationId(), "correlationId");
            equal("subject-1", g.getSubject(), "subject");
            equal("to-1", g.getTo(), "to");
            equal("reply-to-1", g.getReplyTo(), "replyTo");
            equal("reply-session-1", g.getReplyToSessionId(), "replyToSessionId");
            equal("application/octet-stream", g.getContentType(), "contentType");
            equal(Duration.ofMinutes(30), g.getTimeToLive(), "timeToLive");
            equal("session-1", g.getSessionId(), "sessionId");
            equal("session-1", g.getPartitionKey(), "partitionKey");
            equal(scheduled.toInstant(), g.getScheduledEnqueueTime().toInstant(), "scheduledEnqueueTime");
            for (Map.Entry<String, Object> e : props.entrySet()) {
                Object v = g.getApplicationProperties().get(e.getKey());
                equal(e.getValue(), v, "applicationProperties[" + e.getKey() + "]");
            }
            check(g.getSequenceNumber() > 0, "sequenceNumber %d", g.getSequenceNumber());
            check(g.getEnqueuedTime() != null && g.getEnqueuedTime().isAfter(before)
                && g.getEnqueuedTime().isBefore(OffsetDateTime.now(ZoneOffset.UTC).plusSeconds(5)),
                "enqueuedTime %s", g.getEnqueuedTime());
            check(!g.getEnqueuedTime().toInstant().isBefore(scheduled.toInstant().minusMillis(1000)),
                "enqueued %s before its scheduled time %s", g.getEnqueuedTime(), scheduled);
            equal(0L, g.getDeliveryCount(), "deliveryCount");
            check(g.getLockedUntil() != null && g.getLockedUntil().isAfter(OffsetDateTime.now(ZoneOffset.UTC)),
                "lockedUntil %s", g.getLockedUntil());
            check(g.getLockToken() != null && !g.getLockToken().isEmpty(), "no lock token");
            check(g.getExpiresAt() != null, "no expiresAt");
            r.complete(g);
            check(r.peekMessage() == null, "the completed message is still there");
            return "every field round-tripped; seq " + g.getSequenceNumber() + ", enqueued " + g.getEnqueuedTime()
                + ", scheduled " + scheduled;
        }
    }

    /** AMQP value and sequence bodies (ServiceBusMessage(AmqpMessageBody)) come back as they were sent. */
    String bodyTypes() {
        String q = entity("body_types");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            Map<String, Object> map = new LinkedHashMap<>();
            map.put("order", 42L);
            map.put("item", "book");
            s.sendMessages(List.of(
                new ServiceBusMessage(AmqpMessageBody.fromValue("a string value")),
                new ServiceBusMessage(AmqpMessageBody.fromValue(map)),
                new ServiceBusMessage(AmqpMessageBody.fromSequence(List.of("one", 2L, true)))));
            List<ServiceBusReceivedMessage> got = receive(r, 3, Duration.ofSeconds(10));
            equal(3, got.size(), "received");
            AmqpMessageBody first = got.get(0).getRawAmqpMessage().getBody();
            equal(AmqpMessageBodyType.VALUE, first.getBodyType(), "first body type");
            equal("a string value", first.getValue(), "string value");
            AmqpMessageBody second = got.get(1).getRawAmqpMessage().getBody();
            equal(AmqpMessageBodyType.VALUE, second.getBodyType(), "second body type");
            equal(map, second.getValue(), "map value");
            AmqpMessageBody third = got.get(2).getRawAmqpMessage().getBody();
            equal(AmqpMessageBodyType.SEQUENCE, third.getBodyType(), "third body type");
            equal(List.of("one", 2L, true), third.getSequence(), "sequence");
            got.forEach(r::complete);
            return "a string value, a map value and a sequence body came back with their types and contents";
        }
    }

    /** createMessageBatch/tryAddMessage, one send, every message received in order. */
    String batch() {
        String q = entity("batch");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            ServiceBusMessageBatch batch = s.createMessageBatch();
            List<String> sent = new ArrayList<>();
            for (int i = 0; i < 25; i++) {
                check(batch.tryAddMessage(new ServiceBusMessage("batch-" + i)), "tryAddMessage %d refused", i);
                sent.add("batch-" + i);
            }
            equal(25, batch.getCount(), "batch count");
            s.sendMessages(batch);
            s.sendMessages(texts("list-0", "list-1"));
            sent.add("list-0");
            sent.add("list-1");
            List<ServiceBusReceivedMessage> got = receive(r, sent.size(), Duration.ofSeconds(15));
            equal(sent, bodies(got), "bodies");
            long prev = 0;
            for (ServiceBusReceivedMessage m : got) {
                check(m.getSequenceNumber() > prev, "sequence numbers not increasing");
                prev = m.getSequenceNumber();
                r.complete(m);
            }
            return "25 messages in one batch (max size " + batch.getMaxSizeInBytes() + ") and a list of 2, in order";
        }
    }

    /** peekMessage(s), from a sequence number, counting no delivery. */
    String peek() {
        String q = entity("peek");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            s.sendMessages(texts("p0", "p1", "p2", "p3"));
            List<ServiceBusReceivedMessage> all = new ArrayList<>();
            r.peekMessages(10).forEach(all::add);
            equal(List.of("p0", "p1", "p2", "p3"), bodies(all), "peekMessages(10)");
            long second = all.get(1).getSequenceNumber();
            List<ServiceBusReceivedMessage> from = new ArrayList<>();
            r.peekMessages(2, second).forEach(from::add);
            equal(List.of("p1", "p2"), bodies(from), "peekMessages(2, seq of p1)");
            ServiceBusReceivedMessage one = r.peekMessage(all.get(3).getSequenceNumber());
            equal("p3", one == null ? null : one.getBody().toString(), "peekMessage(seq of p3)");
            equal(ServiceBusMessageState.ACTIVE, one.getState(), "state");
            check(r.peekMessage(all.get(3).getSequenceNumber() + 1) == null, "peek past the end returned a message");
            List<ServiceBusReceivedMessage> got = receive(r, 4, Duration.ofSeconds(10));
            equal(4, got.size(), "received after peeking");
            for (ServiceBusReceivedMessage m : got) {
                equal(0L, m.getDeliveryCount(), "deliveryCount after peeks");
                r.complete(m);
            }
            return "peeked 4, 2 from a sequence number, 1 by number, none past the end; peeks count no delivery";
        }
    }

    /** defer, then receiveDeferredMessage / receiveDeferredMessages by sequence number. */
    String defer() {
        String q = entity("defer");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            s.sendMessages(texts("d0", "d1", "d2"));
            List<ServiceBusReceivedMessage> got = receive(r, 3, Duration.ofSeconds(10));
            equal(3, got.size(), "received");
            r.defer(got.get(0), new DeferOptions().setPropertiesToModify(Map.of("deferredBy", "worker-1")));
            r.defer(got.get(1));
            r.defer(got.get(2));
            check(receive(r, 1, Duration.ofSeconds(2)).isEmpty(), "a deferred message was delivered again");
            ServiceBusReceivedMessage peeked = r.peekMessage(got.get(0).getSequenceNumber());
            equal(ServiceBusMessageState.DEFERRED, peeked.getState(), "peeked state");
            ServiceBusReceivedMessage d0 = r.receiveDeferredMessage(got.get(0).getSequenceNumber());
            equal("d0", d0 == null ? null : d0.getBody().toString(), "receiveDeferredMessage");
            check(d0.getLockedUntil() != null && d0.getLockToken() != null, "deferred message without a lock");
            equal("worker-1", d0.getApplicationProperties().get("deferredBy"), "property set by defer");
            r.complete(d0);
            List<ServiceBusReceivedMessage> rest = new ArrayList<>();
            r.receiveDeferredMessageBatch(List.of(got.get(1).getSequenceNumber(), got.get(2).getSequenceNumber()))
                .forEach(rest::add);
            equal(List.of("d1", "d2"), bodies(rest), "receiveDeferredMessageBatch");
            for (ServiceBusReceivedMessage m : rest) {
                r.complete(m);
            }
            check(r.peekMessage() == null, "messages left after completing the deferred ones");
            return "3 deferred (one with propertiesToModify), 1 received by number, 2 by "
                + "receiveDeferredMessageBatch, all completed";
        }
    }

    /** deadLetter with reason and description, read back from the dead-letter sub-queue. */
    String deadLetter() {
        String q = entity("dead_letter");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q);
             ServiceBusReceiverClient dlq = b.receiver().queueName(q).subQueue(SubQueue.DEAD_LETTER_QUEUE)
                 .receiveMode(ServiceBusReceiveMode.PEEK_LOCK).buildClient()) {
            s.sendMessage(new ServiceBusMessage("poison").setMessageId("dl-1"));
            List<ServiceBusReceivedMessage> got = receive(r, 1, Duration.ofSeconds(10));
            equal(1, got.size(), "received");
            r.deadLetter(got.get(0), new DeadLetterOptions().setDeadLetterReason("BadFormat")
                .setDeadLetterErrorDescription("the body is not JSON")
                .setPropertiesToModify(Map.of("checkedBy", "validator")));
            List<ServiceBusReceivedMessage> dead = receive(dlq, 1, Duration.ofSeconds(10));
            equal(1, dead.size(), "dead-lettered messages");
            ServiceBusReceivedMessage d = dead.get(0);
            equal("poison", d.getBody().toString(), "body");
            equal("dl-1", d.getMessageId(), "messageId");
            equal("BadFormat", d.getDeadLetterReason(), "deadLetterReason");
            equal("the body is not JSON", d.getDeadLetterErrorDescription(), "deadLetterErrorDescription");
            equal("validator", d.getApplicationProperties().get("checkedBy"), "property set by deadLetter");
            dlq.complete(d);
            check(r.peekMessage() == null, "the dead-lettered message is still in the queue");
            return "dead-lettered with reason, description and propertiesToModify, read from the DLQ (source "
                + d.getDeadLetterSource() + ")";
        }
    }

    /** abandon makes the message come back with a higher delivery count and modified properties. */
    String abandon() {
        String q = entity("abandon");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            s.sendMessage(new ServiceBusMessage("again"));
            ServiceBusReceivedMessage first = receive(r, 1, Duration.ofSeconds(10)).get(0);
            equal(0L, first.getDeliveryCount(), "first deliveryCount");
            r.abandon(first);
            ServiceBusReceivedMessage second = receive(r, 1, Duration.ofSeconds(10)).get(0);
            equal(1L, second.getDeliveryCount(), "deliveryCount after abandon");
            equal(first.getSequenceNumber(), second.getSequenceNumber(), "sequenceNumber");
            r.abandon(second, new AbandonOptions().setPropertiesToModify(Map.of("attempt", 2)));
            ServiceBusReceivedMessage third = receive(r, 1, Duration.ofSeconds(10)).get(0);
            equal(2L, third.getDeliveryCount(), "deliveryCount after the second abandon");
            equal(2, third.getApplicationProperties().get("attempt"), "property set by abandon");
            r.complete(third);
            return "abandoned twice: delivery count 0, 1, 2; abandon's propertiesToModify applied";
        }
    }

    /** scheduleMessage(s) returns sequence numbers; cancelScheduledMessage(s); a due message arrives. */
    String schedule() throws InterruptedException {
        String q = entity("schedule");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            OffsetDateTime later = OffsetDateTime.now(ZoneOffset.UTC).plusHours(1);
            Long one = s.scheduleMessage(new ServiceBusMessage("one"), later);
            check(one != null && one > 0, "scheduleMessage returned %s", one);
            List<Long> many = new ArrayList<>();
            s.scheduleMessages(texts("m0", "m1", "m2"), later).forEach(many::add);
            equal(3, many.size(), "scheduleMessages sequence numbers " + many);
            ServiceBusReceivedMessage peeked = r.peekMessage(one);
            check(peeked != null && peeked.getState() == ServiceBusMessageState.SCHEDULED,
                "peeked scheduled message %s", peeked == null ? null : peeked.getState());
            equal(later.toInstant().toEpochMilli(), peeked.getScheduledEnqueueTime().toInstant().toEpochMilli(),
                "scheduledEnqueueTime");
            s.cancelScheduledMessage(one);
            s.cancelScheduledMessages(many.subList(0, 2));
            List<ServiceBusReceivedMessage> left = new ArrayList<>();
            r.peekMessages(10, 1).forEach(left::add);
            equal(List.of("m2"), bodies(left), "left after cancelling");
            s.cancelScheduledMessage(many.get(2));
            OffsetDateTime soon = OffsetDateTime.now(ZoneOffset.UTC).plusSeconds(2);
            Long due = s.scheduleMessage(new ServiceBusMessage("due"), soon);
            List<ServiceBusReceivedMessage> early = receive(r, 1, Duration.ofSeconds(1));
            check(early.isEmpty(), "a scheduled message arrived early");
            List<ServiceBusReceivedMessage> got = receive(r, 1, Duration.ofSeconds(10));
            equal(List.of("due"), bodies(got), "received the due message");
            equal(due, got.get(0).getSequenceNumber(), "sequence number of the due message");
            check(!got.get(0).getEnqueuedTime().isBefore(soon.minusSeconds(1)), "enqueued at %s, scheduled %s",
                got.get(0).getEnqueuedTime(), soon);
            r.complete(got.get(0));
            return "scheduled 1 + 3 (numbers " + one + ", " + many + "), cancelled one by one and by a list; "
                + "a message due in 2 s arrived on time";
        }
    }

    /** acceptNextSession, session state, acceptSession by id, renewSessionLock. */
    String sessions() {
        String q = entity("sessions");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusSessionReceiverClient sessions = b.sessionReceiver().queueName(q)
                 .receiveMode(ServiceBusReceiveMode.PEEK_LOCK).maxAutoLockRenewDuration(Duration.ZERO)
                 .buildClient()) {
            List<ServiceBusMessage> out = new ArrayList<>();
            for (String sid : List.of("A", "B")) {
                for (int i = 0; i < 3; i++) {
                    out.add(new ServiceBusMessage(sid + i).setSessionId(sid));
                }
            }
            s.sendMessages(out);
            Set<String> seen = new HashSet<>();
            List<String> report = new ArrayList<>();
            for (int k = 0; k < 2; k++) {
                try (ServiceBusReceiverClient r = sessions.acceptNextSession()) {
                    String sid = r.getSessionId();
                    check(sid != null && seen.add(sid), "acceptNextSession gave %s (seen %s)", sid, seen);
                    check(r.getSessionState() == null, "a new session %s has state", sid);
                    r.setSessionState(("state of " + sid).getBytes(StandardCharsets.UTF_8));
                    equal("state of " + sid, new String(r.getSessionState(), StandardCharsets.UTF_8), "state");
                    List<ServiceBusReceivedMessage> got = receive(r, 3, Duration.ofSeconds(10));
                    equal(List.of(sid + "0", sid + "1", sid + "2"), bodies(got), "session " + sid);
                    for (ServiceBusReceivedMessage m : got) {
                        equal(sid, m.getSessionId(), "sessionId");
                        r.complete(m);
                    }
                    OffsetDateTime renewed = r.renewSessionLock();
                    check(renewed != null && renewed.isAfter(OffsetDateTime.now(ZoneOffset.UTC)),
                        "renewSessionLock returned %s", renewed);
                    report.add(sid);
                }
            }
            equal(Set.of("A", "B"), seen, "sessions");
            s.sendMessage(new ServiceBusMessage("A-again").setSessionId("A"));
            try (ServiceBusReceiverClient r = sessions.acceptSession("A")) {
                equal("state of A", new String(r.getSessionState(), StandardCharsets.UTF_8), "state kept");
                equal(List.of("A-again"), bodies(receive(r, 1, Duration.ofSeconds(10))), "acceptSession(A)");
                r.receiveMessages(1, Duration.ofMillis(1)).forEach(r::complete);
                r.setSessionState(null);
                check(r.getSessionState() == null, "state not cleared");
            }
            return "next-available gave " + report + ", each with state set and read, lock renewed; "
                + "acceptSession(A) read the kept state";
        }
    }

    /** A topic with a SQL, a correlation and a true filter: each subscription gets what its rule matches. */
    String topicFilters() {
        String t = entity("topic_filters");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().topicName(t).buildClient()) {
            ServiceBusMessage red = new ServiceBusMessage("red-5");
            red.getApplicationProperties().put("color", "red");
            red.getApplicationProperties().put("quantity", 5);
            ServiceBusMessage redFew = new ServiceBusMessage("red-1");
            redFew.getApplicationProperties().put("color", "red");
            redFew.getApplicationProperties().put("quantity", 1);
            ServiceBusMessage order = new ServiceBusMessage("order").setCorrelationId("order-42").setSubject("order");
            ServiceBusMessage other = new ServiceBusMessage("other").setCorrelationId("x");
            s.sendMessages(List.of(red, redFew, order, other));
            Map<String, List<String>> got = new LinkedHashMap<>();
            for (String sub : List.of("sql", "correlation", "all")) {
                try (ServiceBusReceiverClient r = b.receiver().topicName(t).subscriptionName(sub).buildClient()) {
                    List<ServiceBusReceivedMessage> ms = receiveExactly(r, sub.equals("all") ? 4 : 1);
                    ms.forEach(r::complete);
                    got.put(sub, bodies(ms));
                }
            }
            equal(List.of("red-5"), got.get("sql"), "sql subscription (color = 'red' AND quantity > 2)");
            equal(List.of("order"), got.get("correlation"), "correlation subscription (correlationId order-42)");
            equal(List.of("red-5", "red-1", "order", "other"), got.get("all"), "true-filter subscription");
            return "sql " + got.get("sql") + ", correlation " + got.get("correlation") + ", all " + got.get("all");
        }
    }

    /** ServiceBusRuleManagerClient: list, create (SQL with an action, correlation) and delete rules; routing follows. */
    String ruleManager() {
        String t = entity("rule_manager");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusRuleManagerClient rules = b.ruleManager().topicName(t).subscriptionName("managed")
                 .buildClient();
             ServiceBusSenderClient s = b.sender().topicName(t).buildClient();
             ServiceBusReceiverClient r = b.receiver().topicName(t).subscriptionName("managed").buildClient()) {
            List<RuleProperties> before = new ArrayList<>();
            rules.listRules().forEach(before::add);
            equal(List.of("$Default"), before.stream().map(RuleProperties::getName).collect(Collectors.toList()),
                "rules of a new subscription");
            check(before.get(0).getFilter() instanceof TrueRuleFilter, "$Default filter %s", before.get(0).getFilter());
            rules.createRule("red", new CreateRuleOptions(new SqlRuleFilter("color = 'red'"))
                .setAction(new SqlRuleAction("SET tagged = 'yes'")));
            CorrelationRuleFilter correlation = new CorrelationRuleFilter().setCorrelationId("order-1");
            correlation.getProperties().put("region", "eu");
            rules.createRule("order", new CreateRuleOptions(correlation));
            rules.deleteRule("$Default");
            Map<String, RuleProperties> after = new LinkedHashMap<>();
            rules.listRules().forEach(rule -> after.put(rule.getName(), rule));
            equal(List.of("red", "order"), new ArrayList<>(after.keySet()), "rules after create and delete");
            RuleProperties red = after.get("red");
            check(red.getFilter() instanceof SqlRuleFilter
                && "color = 'red'".equals(((SqlRuleFilter) red.getFilter()).getSqlExpression()),
                "red's filter %s", red.getFilter());
            check(red.getAction() instanceof SqlRuleAction
                && "SET tagged = 'yes'".equals(((SqlRuleAction) red.getAction()).getSqlExpression()),
                "red's action %s", red.getAction());
            RuleProperties order = after.get("order");
            check(order.getFilter() instanceof CorrelationRuleFilter, "order's filter %s", order.getFilter());
            CorrelationRuleFilter got = (CorrelationRuleFilter) order.getFilter();
            equal("order-1", got.getCorrelationId(), "order's correlationId");
            equal("eu", got.getProperties().get("region"), "order's property");
            String duplicate = null;
            try {
                rules.createRule("red", new CreateRuleOptions(new SqlRuleFilter("1=1")));
            } catch (RuntimeException e) {
                duplicate = e.getClass().getSimpleName();
            }
            check(duplicate != null, "a second rule named red was created");

            ServiceBusMessage redMsg = new ServiceBusMessage("red");
            redMsg.getApplicationProperties().put("color", "red");
            ServiceBusMessage blue = new ServiceBusMessage("blue");
            blue.getApplicationProperties().put("color", "blue");
            ServiceBusMessage euOrder = new ServiceBusMessage("eu-order").setCorrelationId("order-1");
            euOrder.getApplicationProperties().put("region", "eu");
            ServiceBusMessage usOrder = new ServiceBusMessage("us-order").setCorrelationId("order-1");
            usOrder.getApplicationProperties().put("region", "us");
            s.sendMessages(List.of(redMsg, blue, euOrder, usOrder));
            List<ServiceBusReceivedMessage> msgs = receiveExactly(r, 2);
            msgs.forEach(r::complete);
            equal(List.of("red", "eu-order"), bodies(msgs), "routed by the new rules");
            equal("yes", msgs.get(0).getApplicationProperties().get("tagged"), "the red rule's action");
            return "listed $Default (true), created a SQL rule with an action and a correlation rule, deleted "
                + "$Default, a duplicate name refused (" + duplicate + "); routing followed";
        }
    }

    /**
     * ServiceBusAdministrationClient against the emulator's admin port. The client always builds
     * {@code https://<host>/} URLs from the connection string; a pipeline policy sends them to the admin endpoint
     * over plain HTTP (the Java counterpart of spark_sb.admin.admin_client). Create, get, update, list, runtime
     * counts, topic, subscription and rule, exists, a duplicate refused, delete.
     */
    String administration() {
        check(adminEndpoint != null, "SB_ADMIN_ENDPOINT is not set");
        URL admin;
        try {
            admin = new URL(adminEndpoint);
        } catch (MalformedURLException e) {
            throw new Failed("SB_ADMIN_ENDPOINT " + adminEndpoint + ": " + e.getMessage());
        }
        HttpPipelinePolicy toEmulator = new HttpPipelinePolicy() {
            @Override
            public reactor.core.publisher.Mono<com.azure.core.http.HttpResponse> process(
                com.azure.core.http.HttpPipelineCallContext context, com.azure.core.http.HttpPipelineNextPolicy next) {
                URL url = context.getHttpRequest().getUrl();
                try {
                    context.getHttpRequest().setUrl(new URL(admin.getProtocol(), admin.getHost(), admin.getPort(),
                        url.getFile()));
                } catch (MalformedURLException e) {
                    return reactor.core.publisher.Mono.error(e);
                }
                return next.process();
            }

            @Override
            public HttpPipelinePosition getPipelinePosition() {
                return HttpPipelinePosition.PER_RETRY;
            }
        };
        ServiceBusAdministrationClient a = new ServiceBusAdministrationClientBuilder()
            .connectionString(connectionString).addPolicy(toEmulator).buildClient();
        String q = prefix + "admin-q";
        String t = prefix + "admin-t";
        QueueProperties created = a.createQueue(q, new CreateQueueOptions().setMaxDeliveryCount(3)
            .setLockDuration(Duration.ofSeconds(20)).setDuplicateDetectionRequired(true));
        equal(3, created.getMaxDeliveryCount(), "created maxDeliveryCount");
        check(a.getQueueExists(q), "getQueueExists(%s) false", q);
        String duplicate = null;
        try {
            a.createQueue(q);
        } catch (ResourceExistsException e) {
            duplicate = e.getClass().getSimpleName();
        }
        check(duplicate != null, "a second queue %s was created", q);
        QueueProperties got = a.getQueue(q);
        equal(Duration.ofSeconds(20), got.getLockDuration(), "lockDuration");
        check(got.isDuplicateDetectionRequired(), "duplicate detection not kept");
        got.setMaxDeliveryCount(7);
        equal(7, a.updateQueue(got).getMaxDeliveryCount(), "updated maxDeliveryCount");
        try (ServiceBusSenderClient s = builder().sender().queueName(q).buildClient()) {
            s.sendMessages(texts("x", "y"));
        }
        QueueRuntimeProperties runtime = a.getQueueRuntimeProperties(q);
        equal(2, runtime.getActiveMessageCount(), "activeMessageCount");
        check(a.listQueues().stream().anyMatch(p -> p.getName().equals(q)), "listQueues lacks %s", q);
        a.createTopic(t);
        a.createSubscription(t, "sub");
        a.createRule(t, "red", "sub", new CreateRuleOptions(new SqlRuleFilter("color = 'red'")));
        List<String> ruleNames = a.listRules(t, "sub").stream().map(RuleProperties::getName)
            .collect(Collectors.toList());
        equal(List.of("$Default", "red"), ruleNames, "rules");
        a.deleteTopic(t);
        a.deleteQueue(q);
        check(!a.getQueueExists(q), "the deleted queue still exists");
        String missing = null;
        try {
            a.getQueue(q);
        } catch (ResourceNotFoundException e) {
            missing = e.getClass().getSimpleName();
        }
        check(missing != null, "getQueue of a deleted queue did not raise ResourceNotFoundException");
        return "created, read, updated, listed, counted (2 active) and deleted a queue; topic, subscription, rule; "
            + duplicate + " for a duplicate, " + missing + " after delete";
    }

    /** The same messageId twice within the window is stored once. */
    String duplicateDetection() {
        String q = entity("duplicate_detection");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            s.sendMessage(new ServiceBusMessage("first").setMessageId("dup-1"));
            s.sendMessage(new ServiceBusMessage("second").setMessageId("dup-1"));
            s.sendMessage(new ServiceBusMessage("third").setMessageId("dup-2"));
            List<ServiceBusReceivedMessage> got = receiveExactly(r, 2);
            got.forEach(r::complete);
            equal(List.of("first", "third"), bodies(got), "received");
            return "a repeated messageId was accepted and dropped";
        }
    }

    /** renewMessageLock moves lockedUntil on; the message stays locked past its first lock. */
    String lockRenewal() throws InterruptedException {
        String q = entity("lock_renewal");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = b.receiver().queueName(q).maxAutoLockRenewDuration(Duration.ZERO)
                 .buildClient()) {
            s.sendMessage(new ServiceBusMessage("long work"));
            ServiceBusReceivedMessage m = receive(r, 1, Duration.ofSeconds(10)).get(0);
            OffsetDateTime first = m.getLockedUntil();
            Thread.sleep(1500);
            OffsetDateTime renewed = r.renewMessageLock(m);
            check(renewed != null && renewed.isAfter(first), "renewMessageLock returned %s, first lock %s", renewed,
                first);
            // the SDK does not update the message's lockedUntil on renewal (it keeps the received value)
            // past the first lock (5 s): still locked, so complete succeeds and nobody else got it
            Thread.sleep(Math.max(0, Duration.between(OffsetDateTime.now(ZoneOffset.UTC), first).toMillis() + 1000));
            r.complete(m);
            check(r.peekMessage() == null, "message still there after completing it");
            return "lock " + first + " renewed to " + renewed + "; completed after the first lock ended";
        }
    }

    /** ServiceBusProcessorClient receives N messages and completes them. */
    String processor() throws InterruptedException {
        String q = entity("processor");
        int n = 30;
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient()) {
            List<ServiceBusMessage> out = new ArrayList<>();
            for (int i = 0; i < n; i++) {
                out.add(new ServiceBusMessage("proc-" + i));
            }
            s.sendMessages(out);
        }
        Set<String> got = ConcurrentHashMap.newKeySet();
        List<String> errors = Collections.synchronizedList(new ArrayList<>());
        CountDownLatch all = new CountDownLatch(n);
        ServiceBusProcessorClient p = builder().processor().queueName(q).maxConcurrentCalls(4)
            .processMessage((ServiceBusReceivedMessageContext ctx) -> {
                if (got.add(ctx.getMessage().getBody().toString())) {
                    all.countDown();
                }
            })
            .processError((ServiceBusErrorContext ctx) -> errors.add(describe(ctx.getException())))
            .buildProcessorClient();
        p.start();
        boolean done = all.await(30, TimeUnit.SECONDS);
        // the processor completes each message after processMessage returns: wait for the queue to empty
        boolean empty = false;
        try (ServiceBusReceiverClient r = receiver(builder(), q)) {
            long deadline = System.nanoTime() + Duration.ofSeconds(10).toNanos();
            while (!(empty = r.peekMessage() == null) && System.nanoTime() < deadline) {
                Thread.sleep(100);
            }
        }
        long closing = System.nanoTime();
        p.close();
        double closeS = (System.nanoTime() - closing) / 1e9;
        check(done, "processor got %d of %d; errors %s", got.size(), n, errors);
        check(empty, "messages left: the processor did not complete them");
        check(errors.isEmpty(), "processError called: %s", errors);
        check(closeS < 10, "processor close took %.1f s", closeS);
        return String.format("processor received and auto-completed %d messages; close %.1f s", n, closeS);
    }

    /** ServiceBusSessionProcessorClient over three sessions, two at a time, each session's messages in order. */
    String sessionProcessor() throws InterruptedException {
        String q = entity("session_processor");
        ServiceBusClientBuilder b = builder();
        Map<String, List<String>> expected = new LinkedHashMap<>();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient()) {
            List<ServiceBusMessage> out = new ArrayList<>();
            for (String sid : List.of("s1", "s2", "s3")) {
                List<String> bodies = new ArrayList<>();
                for (int i = 0; i < 5; i++) {
                    out.add(new ServiceBusMessage(sid + "-" + i).setSessionId(sid));
                    bodies.add(sid + "-" + i);
                }
                expected.put(sid, bodies);
            }
            s.sendMessages(out);
        }
        Map<String, List<String>> got = new ConcurrentHashMap<>();
        List<String> errors = Collections.synchronizedList(new ArrayList<>());
        CountDownLatch all = new CountDownLatch(15);
        ServiceBusProcessorClient p = builder().sessionProcessor().queueName(q).maxConcurrentSessions(2)
            .sessionIdleTimeout(Duration.ofSeconds(1))
            .processMessage(ctx -> {
                ServiceBusReceivedMessage m = ctx.getMessage();
                got.computeIfAbsent(m.getSessionId(), k -> Collections.synchronizedList(new ArrayList<>()))
                    .add(m.getBody().toString());
                all.countDown();
            })
            .processError(ctx -> errors.add(describe(ctx.getException())))
            .buildProcessorClient();
        p.start();
        boolean done = all.await(40, TimeUnit.SECONDS);
        boolean empty = false;
        try (ServiceBusReceiverClient r = receiver(builder(), q)) {
            long deadline = System.nanoTime() + Duration.ofSeconds(10).toNanos();
            while (!(empty = r.peekMessage() == null) && System.nanoTime() < deadline) {
                Thread.sleep(100);
            }
        }
        long closing = System.nanoTime();
        p.close();
        double closeS = (System.nanoTime() - closing) / 1e9;
        check(done, "session processor got %s; errors %s", got, errors);
        equal(expected, new java.util.TreeMap<>(got), "messages per session, in order");
        check(empty, "messages left: the session processor did not complete them");
        check(errors.isEmpty(), "processError called: %s", errors);
        check(closeS < 10, "session processor close took %.1f s", closeS);
        return String.format("3 sessions x 5 messages, 2 sessions at a time, each in order; close %.1f s", closeS);
    }

    /** RECEIVE_AND_DELETE: messages are gone once received; a deferred message is received and deleted. */
    String receiveAndDelete() {
        String q = entity("receive_and_delete");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient peekLock = receiver(b, q);
             ServiceBusReceiverClient r = b.receiver().queueName(q).receiveMode(ServiceBusReceiveMode.RECEIVE_AND_DELETE)
                 .buildClient()) {
            s.sendMessages(texts("r0", "r1", "r2"));
            ServiceBusReceivedMessage toDefer = receive(peekLock, 1, Duration.ofSeconds(10)).get(0);
            peekLock.defer(toDefer);
            List<ServiceBusReceivedMessage> got = receive(r, 2, Duration.ofSeconds(10));
            equal(List.of("r1", "r2"), bodies(got), "received and deleted");
            ServiceBusReceivedMessage deferred = r.receiveDeferredMessage(toDefer.getSequenceNumber());
            equal("r0", deferred == null ? null : deferred.getBody().toString(), "deferred, received and deleted");
            check(peekLock.peekMessage() == null, "messages left after receive-and-delete");
            return "2 received and deleted, 1 deferred then received by number and deleted; nothing left";
        }
    }

    /**
     * Transactions: the emulator has none (a known difference). createTransaction must fail at once with an
     * error naming it, not hang or blame authorisation; sends outside a transaction go on working.
     */
    String transactionsRefused() {
        String q = entity("transactions_refused");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            long started = System.nanoTime();
            String refused = null;
            try {
                ServiceBusTransactionContext tx = s.createTransaction();
                s.sendMessage(new ServiceBusMessage("in a transaction"), tx);
                s.commitTransaction(tx);
            } catch (RuntimeException e) {
                refused = describe(e);
            }
            double took = (System.nanoTime() - started) / 1e9;
            check(refused != null, "a transaction was committed: the emulator has no transactions");
            check(refused.contains("Transactions are not supported"), "refused with another error: %s", refused);
            check(took < 10, "the refusal took %.1f s", took);
            s.sendMessage(new ServiceBusMessage("outside"));
            List<ServiceBusReceivedMessage> got = receive(r, 1, Duration.ofSeconds(10));
            equal(List.of("outside"), bodies(got), "a send after the refusal");
            r.complete(got.get(0));
            return String.format("createTransaction refused in %.1f s (%s); sends without one work", took, refused);
        }
    }

    /** ServiceBusSenderAsyncClient / ServiceBusReceiverAsyncClient. */
    String asyncClients() {
        String q = entity("async_clients");
        ServiceBusClientBuilder b = builder();
        ServiceBusSenderAsyncClient s = b.sender().queueName(q).buildAsyncClient();
        // auto-complete off: the scenario completes each message itself
        ServiceBusReceiverAsyncClient r = b.receiver().queueName(q).receiveMode(ServiceBusReceiveMode.PEEK_LOCK)
            .disableAutoComplete().buildAsyncClient();
        try {
            s.sendMessages(texts("a0", "a1", "a2")).block(WAIT);
            s.createMessageBatch().flatMap(batch -> {
                batch.tryAddMessage(new ServiceBusMessage("a3"));
                return s.sendMessages(batch);
            }).block(WAIT);
            Long seq = s.scheduleMessage(new ServiceBusMessage("later"), OffsetDateTime.now(ZoneOffset.UTC).plusHours(1))
                .block(WAIT);
            check(seq != null && seq > 0, "async scheduleMessage returned %s", seq);
            s.cancelScheduledMessage(seq).block(WAIT);
            // complete before take: take's cancel closes the receive link, and a completion still waiting
            // for its acknowledgement then fails (the SDK's behaviour against Service Bus too)
            List<String> bodies = r.receiveMessages()
                .concatMap(m -> r.complete(m).thenReturn(m.getBody().toString()))
                .take(4)
                .collectList()
                .block(Duration.ofSeconds(20));
            equal(List.of("a0", "a1", "a2", "a3"), bodies, "received asynchronously");
            ServiceBusReceivedMessage left = r.peekMessage().block(WAIT);
            check(left == null, "left after completing: %s", left == null ? null : left.getBody());
            return "sent 3 + a batch of 1, scheduled and cancelled one, received and completed 4 asynchronously";
        } finally {
            s.close();
            r.close();
        }
    }

    /**
     * 256 KiB: the SDK takes the limit from the emulator's attach (link max-message-size) and refuses a larger
     * message before sending it (sendMessage and tryAddMessage throw, as against Service Bus); a batch that
     * would outgrow it says false; a message just under it goes through and comes back whole.
     */
    String sizeLimit() {
        String q = entity("size_limit");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            ServiceBusMessageBatch batch = s.createMessageBatch();
            long max = batch.getMaxSizeInBytes();
            check(max == 256 * 1024, "batch max size %d, expected 262144 (the link's max-message-size)", max);
            check(batch.tryAddMessage(new ServiceBusMessage(BinaryData.fromBytes(new byte[200 * 1024]))),
                "tryAddMessage refused 200 KiB into an empty batch");
            check(!batch.tryAddMessage(new ServiceBusMessage(BinaryData.fromBytes(new byte[100 * 1024]))),
                "tryAddMessage took 100 KiB more into a batch holding 200 KiB");
            String tooBig = null;
            try {
                batch.tryAddMessage(new ServiceBusMessage(BinaryData.fromBytes(new byte[300 * 1024])));
            } catch (RuntimeException e) {
                tooBig = e.getMessage();
            }
            check(tooBig != null, "tryAddMessage of a single 300 KiB message neither threw nor refused");
            String refused = null;
            try {
                s.sendMessage(new ServiceBusMessage(BinaryData.fromBytes(new byte[300 * 1024])));
            } catch (RuntimeException e) {
                refused = e.getMessage();
            }
            check(refused != null, "a 300 KiB message was sent");
            s.sendMessages(batch);
            s.sendMessage(new ServiceBusMessage(BinaryData.fromBytes(new byte[250 * 1024])));
            List<ServiceBusReceivedMessage> got = receive(r, 2, Duration.ofSeconds(10));
            equal(List.of(200 * 1024, 250 * 1024),
                got.stream().map(m -> m.getBody().toBytes().length).collect(Collectors.toList()), "sizes received");
            got.forEach(r::complete);
            return "limit 262144 from the link; 300 KiB refused by sendMessage (" + refused
                + ") and by tryAddMessage; a full batch says false; 200 KiB in a batch and 250 KiB alone received";
        }
    }

    /**
     * What the SDK raised for an action: the ServiceBusException's reason, or, where the SDK gives none (retries
     * exhausted: GENERAL_ERROR; acceptSession: a bare AmqpException), the AMQP error condition in the chain.
     */
    private static String reasonOf(Runnable action) {
        try {
            action.run();
            return "no error";
        } catch (RuntimeException e) {
            if (e instanceof ServiceBusException
                && ((ServiceBusException) e).getReason() != ServiceBusFailureReason.GENERAL_ERROR) {
                return ((ServiceBusException) e).getReason().toString();
            }
            for (Throwable t = e; t != null; t = t.getCause()) {
                if (t instanceof com.azure.core.amqp.exception.AmqpException
                    && ((com.azure.core.amqp.exception.AmqpException) t).getErrorCondition() != null) {
                    return "condition "
                        + ((com.azure.core.amqp.exception.AmqpException) t).getErrorCondition().getErrorCondition();
                }
            }
            return describe(e);
        }
    }

    /**
     * The SDK's failure reasons for the emulator's errors: a missing entity, a disabled one, a busy one (a fault
     * injected by the test on {@code <prefix>errors-busy}), a lost message lock, a session locked by another
     * receiver, a wrong key.
     */
    String errors() throws InterruptedException {
        String q = entity("errors");
        Map<String, String> got = new LinkedHashMap<>();
        Map<String, String> expected = new LinkedHashMap<>();
        ServiceBusClientBuilder b = builder();
        // no retries: a busy entity is reported at once
        ServiceBusClientBuilder once = new ServiceBusClientBuilder().connectionString(connectionString)
            .retryOptions(new AmqpRetryOptions().setMaxRetries(0).setTryTimeout(Duration.ofSeconds(10)));
        try (ServiceBusSenderClient missing = b.sender().queueName(prefix + "no-such-queue").buildClient()) {
            got.put("missing queue", reasonOf(() -> missing.sendMessage(new ServiceBusMessage("x"))));
            expected.put("missing queue", ServiceBusFailureReason.MESSAGING_ENTITY_NOT_FOUND.toString());
        }
        try (ServiceBusSenderClient disabled = b.sender().queueName(entity("errors_disabled")).buildClient()) {
            got.put("disabled queue", reasonOf(() -> disabled.sendMessage(new ServiceBusMessage("x"))));
            expected.put("disabled queue", ServiceBusFailureReason.MESSAGING_ENTITY_DISABLED.toString());
        }
        try (ServiceBusSenderClient busy = once.sender().queueName(entity("errors_busy")).buildClient()) {
            got.put("busy queue", reasonOf(() -> busy.sendMessage(new ServiceBusMessage("x"))));
            // after its retries the SDK raises GENERAL_ERROR (Reactor's RetryExhaustedException) over the
            // server-busy error, as against Service Bus
            expected.put("busy queue", "condition com.microsoft:server-busy");
        }
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = b.receiver().queueName(q).maxAutoLockRenewDuration(Duration.ZERO)
                 .buildClient()) {
            s.sendMessage(new ServiceBusMessage("slow"));
            ServiceBusReceivedMessage m = receive(r, 1, Duration.ofSeconds(10)).get(0);
            Thread.sleep(Math.max(0, Duration.between(OffsetDateTime.now(ZoneOffset.UTC), m.getLockedUntil())
                .toMillis() + 1500));
            got.put("complete after the lock expired", reasonOf(() -> r.complete(m)));
            expected.put("complete after the lock expired", ServiceBusFailureReason.MESSAGE_LOCK_LOST.toString());
            ServiceBusReceivedMessage again = receive(r, 1, Duration.ofSeconds(10)).get(0);
            equal(1L, again.getDeliveryCount(), "deliveryCount after the lock expired");
            r.complete(again);
        }
        String sq = entity("sessions");
        try (ServiceBusSenderClient s = b.sender().queueName(sq).buildClient();
             ServiceBusSessionReceiverClient first = b.sessionReceiver().queueName(sq).buildClient();
             ServiceBusSessionReceiverClient second = builder().sessionReceiver().queueName(sq).buildClient()) {
            s.sendMessage(new ServiceBusMessage("held").setSessionId("held"));
            try (ServiceBusReceiverClient holder = first.acceptSession("held")) {
                got.put("session locked elsewhere", reasonOf(() -> second.acceptSession("held").close()));
                // acceptSession raises the AmqpException itself, not a ServiceBusException
                expected.put("session locked elsewhere", "condition com.microsoft:session-cannot-be-locked");
                receive(holder, 1, Duration.ofSeconds(10)).forEach(holder::complete);
            }
        }
        String wrongKey = connectionString.replaceAll("SharedAccessKey=[^;]*", "SharedAccessKey=d3Jvbmc=");
        try (ServiceBusSenderClient s = new ServiceBusClientBuilder().connectionString(wrongKey)
                 .retryOptions(new AmqpRetryOptions().setMaxRetries(0).setTryTimeout(Duration.ofSeconds(10)))
                 .sender().queueName(q).buildClient()) {
            got.put("wrong key", reasonOf(() -> s.sendMessage(new ServiceBusMessage("x"))));
            expected.put("wrong key", ServiceBusFailureReason.UNAUTHORIZED.toString());
        }
        equal(expected, got, "failure reasons");
        return "reasons: " + got;
    }

    /** POST to the emulator's fault control ({admin}/$emulator/fault), as spark_sb.emulator.fault does. */
    private void injectFault(String kind, String entity, double seconds) throws Exception {
        String body = String.format(java.util.Locale.ROOT, "{\"kind\": %s, \"entity\": %s, \"duration\": %s}",
            json(kind), json(entity), seconds);
        java.net.http.HttpResponse<String> response = java.net.http.HttpClient.newHttpClient().send(
            java.net.http.HttpRequest.newBuilder(java.net.URI.create(adminEndpoint + "/$emulator/fault"))
                .header("Content-Type", "application/json")
                .header("X-Spark-SB-Emulator", "1")  // the controls refuse what a web page could send without it
                .POST(java.net.http.HttpRequest.BodyPublishers.ofString(body)).build(),
            java.net.http.HttpResponse.BodyHandlers.ofString());
        check(response.statusCode() == 200, "fault control answered %d: %s", response.statusCode(), response.body());
    }

    /**
     * An outage of the entity (the emulator's "down" fault for 3 s: links detached, new ones refused): a send during
     * it is retried by the SDK and succeeds once the entity is back; the receiver gets every message.
     */
    String outageRecovery() throws Exception {
        check(adminEndpoint != null, "SB_ADMIN_ENDPOINT is not set");
        String q = entity("outage_recovery");
        ServiceBusClientBuilder b = new ServiceBusClientBuilder().connectionString(connectionString)
            .retryOptions(new AmqpRetryOptions().setMode(AmqpRetryMode.FIXED).setDelay(Duration.ofSeconds(1))
                .setMaxRetries(10).setTryTimeout(Duration.ofSeconds(5)));
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q)) {
            s.sendMessage(new ServiceBusMessage("before"));
            List<ServiceBusReceivedMessage> first = receive(r, 1, Duration.ofSeconds(10));
            equal(List.of("before"), bodies(first), "before the outage");
            first.forEach(r::complete);
            injectFault("down", q, 3);
            long started = System.nanoTime();
            s.sendMessage(new ServiceBusMessage("during"));
            double took = (System.nanoTime() - started) / 1e9;
            // the try timeout and more: the emulator rejects the transfer of a link opened during the fault and
            // detaches it; the SDK schedules its retry on that link and waits out its try timeout before a new one
            check(took < 30, "the send during the outage took %.1f s", took);
            List<ServiceBusReceivedMessage> after = receive(r, 1, Duration.ofSeconds(20));
            equal(List.of("during"), bodies(after), "after the outage");
            after.forEach(r::complete);
            check(r.peekMessage() == null, "messages left after the outage");
            return String.format("a send during a 3 s outage of the queue succeeded after %.1f s; received after it",
                took);
        }
    }

    /** A message whose time to live passes is dead-lettered (the queue says so) with TTLExpiredException. */
    String ttlExpiry() throws InterruptedException {
        String q = entity("ttl_expiry");
        ServiceBusClientBuilder b = builder();
        try (ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
             ServiceBusReceiverClient r = receiver(b, q);
             ServiceBusReceiverClient dlq = b.receiver().queueName(q).subQueue(SubQueue.DEAD_LETTER_QUEUE)
                 .buildClient()) {
            s.sendMessage(new ServiceBusMessage("short-lived").setTimeToLive(Duration.ofSeconds(1)));
            s.sendMessage(new ServiceBusMessage("long-lived"));
            Thread.sleep(1500);
            List<ServiceBusReceivedMessage> live = receive(r, 1, Duration.ofSeconds(10));
            receive(r, 1, Duration.ofMillis(500)).forEach(live::add);
            equal(List.of("long-lived"), bodies(live), "received after the TTL passed");
            live.forEach(r::complete);
            List<ServiceBusReceivedMessage> dead = receive(dlq, 1, Duration.ofSeconds(10));
            equal(List.of("short-lived"), bodies(dead), "dead-lettered");
            equal("TTLExpiredException", dead.get(0).getDeadLetterReason(), "deadLetterReason");
            dead.forEach(dlq::complete);
            return "the expired message went to the DLQ with reason " + dead.get(0).getDeadLetterReason();
        }
    }

    /** Closing clients returns promptly, idle or after work. */
    String close() {
        String q = entity("close");
        ServiceBusClientBuilder b = builder();
        ServiceBusSenderClient s = b.sender().queueName(q).buildClient();
        ServiceBusReceiverClient r = receiver(b, q);
        ServiceBusSessionReceiverClient idle = builder().sessionReceiver().queueName(entity("sessions"))
            .buildClient();
        s.sendMessage(new ServiceBusMessage("c"));
        ServiceBusReceivedMessage m = receive(r, 1, Duration.ofSeconds(10)).get(0);
        r.complete(m);
        // a receive that is waiting when close comes
        r.receiveMessages(1, Duration.ofMillis(200)).forEach(r::complete);
        Map<String, Double> times = new LinkedHashMap<>();
        long t0 = System.nanoTime();
        s.close();
        times.put("sender", (System.nanoTime() - t0) / 1e9);
        t0 = System.nanoTime();
        r.close();
        times.put("receiver", (System.nanoTime() - t0) / 1e9);
        t0 = System.nanoTime();
        idle.close();
        times.put("idle session receiver", (System.nanoTime() - t0) / 1e9);
        for (Map.Entry<String, Double> e : times.entrySet()) {
            check(e.getValue() < 5.0, "closing the %s took %.1f s", e.getKey(), e.getValue());
        }
        return "close times (s): " + times.entrySet().stream()
            .map(e -> String.format("%s %.2f", e.getKey(), e.getValue())).collect(Collectors.joining(", "));
    }

    // ------------------------------------------------------------------ the Python sink's fast path (issue 50)

    /** The class name each AMQP type of application property arrives as through this SDK (proton-j's types). */
    private static final Map<String, String> JAVA_TYPES = Map.ofEntries(
        Map.entry("string", "String"), Map.entry("symbol", "Symbol"), Map.entry("binary", "Binary"),
        Map.entry("boolean", "Boolean"), Map.entry("byte", "Byte"), Map.entry("short", "Short"),
        Map.entry("int", "Integer"), Map.entry("long", "Long"), Map.entry("ubyte", "UnsignedByte"),
        Map.entry("ushort", "UnsignedShort"), Map.entry("uint", "UnsignedInteger"),
        Map.entry("ulong", "UnsignedLong"), Map.entry("float", "Float"), Map.entry("double", "Double"),
        Map.entry("timestamp", "Date"), Map.entry("uuid", "UUID"), Map.entry("decimal128", "Decimal128"));

    /** The message annotations the broker sets on a delivery (the lock's on a peek-locked one only), not the sender. */
    private static final Set<String> BROKER_ANNOTATIONS = Set.of("x-opt-enqueued-time", "x-opt-sequence-number",
        "x-opt-enqueue-sequence-number", "x-opt-locked-until", "x-opt-lock-token", "x-opt-message-state");

    /** A property value as text: what the row held (a Date's milliseconds, a Binary's base64). */
    private static String canon(Object v) {
        if (v == null) {
            return null;
        }
        if (v instanceof org.apache.qpid.proton.amqp.Binary) {
            org.apache.qpid.proton.amqp.Binary bin = (org.apache.qpid.proton.amqp.Binary) v;
            return java.util.Base64.getEncoder().encodeToString(
                Arrays.copyOfRange(bin.getArray(), bin.getArrayOffset(), bin.getArrayOffset() + bin.getLength()));
        }
        if (v instanceof java.util.Date) {
            return String.valueOf(((java.util.Date) v).getTime());
        }
        if (v instanceof org.apache.qpid.proton.amqp.Decimal128) {
            org.apache.qpid.proton.amqp.Decimal128 d = (org.apache.qpid.proton.amqp.Decimal128) v;
            return "decimal128:" + d.getMostSignificantBits() + ":" + d.getLeastSignificantBits();
        }
        return v.toString();
    }

    private static String typeName(Object v) {
        return v == null ? "null" : v.getClass().getSimpleName();
    }

    /** Everything this SDK tells of a received message but what the broker sets (times, sequence numbers, locks). */
    private static Map<String, Object> fieldsOf(ServiceBusReceivedMessage m) {
        Map<String, Object> d = new java.util.TreeMap<>();
        d.put("body", java.util.Base64.getEncoder().encodeToString(m.getBody().toBytes()));
        d.put("bodyType", String.valueOf(m.getRawAmqpMessage().getBody().getBodyType()));
        d.put("message_id", m.getMessageId());
        d.put("session_id", m.getSessionId());
        d.put("partition_key", m.getPartitionKey());
        d.put("subject", m.getSubject());
        d.put("content_type", m.getContentType());
        d.put("correlation_id", m.getCorrelationId());
        d.put("to", m.getTo());
        d.put("reply_to", m.getReplyTo());
        d.put("reply_to_session_id", m.getReplyToSessionId());
        d.put("time_to_live", String.valueOf(m.getTimeToLive()));
        d.put("scheduled_enqueue_time", String.valueOf(m.getScheduledEnqueueTime()));
        com.azure.core.amqp.models.AmqpMessageHeader h = m.getRawAmqpMessage().getHeader();
        d.put("header", h == null ? null : Arrays.asList(h.isDurable(), h.getPriority(), h.isFirstAcquirer(),
            String.valueOf(h.getTimeToLive())));
        com.azure.core.amqp.models.AmqpMessageProperties p = m.getRawAmqpMessage().getProperties();
        d.put("amqp_properties", p == null ? null : Arrays.asList(
            p.getUserId() == null ? null : Arrays.toString(p.getUserId()), String.valueOf(p.getContentEncoding()),
            String.valueOf(p.getGroupSequence()), String.valueOf(p.getCreationTime()),
            String.valueOf(p.getAbsoluteExpiryTime())));
        java.util.TreeSet<String> annotations = new java.util.TreeSet<>(m.getRawAmqpMessage().getMessageAnnotations()
            .keySet());
        annotations.removeAll(BROKER_ANNOTATIONS);
        d.put("annotation_names", annotations);
        d.put("application_property_order", new ArrayList<>(m.getApplicationProperties().keySet()));
        Map<String, String> props = new java.util.TreeMap<>();
        for (Map.Entry<String, Object> e : m.getApplicationProperties().entrySet()) {
            props.put(e.getKey(), typeName(e.getValue()) + " " + canon(e.getValue()));
        }
        d.put("application_properties", props);
        return d;
    }

    /** The messages of a queue (a session's, when {@code sessionId} is set), received and deleted. */
    private List<ServiceBusReceivedMessage> receiveAll(String queue, String sessionId, int n) {
        ServiceBusClientBuilder b = builder();
        if (sessionId == null) {
            try (ServiceBusReceiverClient r = b.receiver().queueName(queue)
                     .receiveMode(ServiceBusReceiveMode.RECEIVE_AND_DELETE).buildClient()) {
                return receiveExactly(r, n);
            }
        }
        try (ServiceBusSessionReceiverClient sessions = b.sessionReceiver().queueName(queue)
                 .receiveMode(ServiceBusReceiveMode.RECEIVE_AND_DELETE).buildClient();
             ServiceBusReceiverClient r = sessions.acceptSession(sessionId)) {
            return receiveExactly(r, n);
        }
    }

    /**
     * Messages the Python sink sent with its fast encoder (spark_sb.wire), received here: every field and each
     * application property's value and Java type as the row gave them, and the same as what the sink sent with the
     * SDK's encoder (sink.encoder: sdk) to the other queues. The rows and the queues: SB_FAST_PATH, made by
     * tests/sdks/fast_path.py.
     */
    @SuppressWarnings("unchecked")
    String pythonFastPath() throws Exception {
        String spec = System.getenv("SB_FAST_PATH");
        check(spec != null, "SB_FAST_PATH is not set");
        Map<String, Object> input = new com.fasterxml.jackson.databind.ObjectMapper().readValue(spec, Map.class);
        Map<String, String> queues = (Map<String, String>) input.get("queues");
        String sessionId = (String) input.get("session_id");
        List<Map<String, Object>> rows = (List<Map<String, Object>>) input.get("messages");
        Map<String, Map<String, Object>> described = new LinkedHashMap<>();
        int properties = 0;
        for (boolean session : new boolean[] {false, true}) {
            List<Map<String, Object>> expected = rows.stream().filter(row -> session == (Boolean) row.get("session"))
                .collect(Collectors.toList());
            List<String> ids = expected.stream().map(row -> (String) row.get("message_id"))
                .collect(Collectors.toList());
            Map<String, List<ServiceBusReceivedMessage>> got = new LinkedHashMap<>();
            for (String encoder : new String[] {"fast", "sdk"}) {
                String queue = queues.get(session ? encoder + "_session" : encoder);
                List<ServiceBusReceivedMessage> messages = receiveAll(queue, session ? sessionId : null, ids.size());
                equal(ids, messages.stream().map(ServiceBusReceivedMessage::getMessageId).collect(Collectors.toList()),
                    "the message ids in " + queue + " (" + encoder + " encoder), in order");
                got.put(encoder, messages);
            }
            for (int i = 0; i < expected.size(); i++) {
                Map<String, Object> row = expected.get(i);
                String id = (String) row.get("message_id");
                Map<String, Object> fast = fieldsOf(got.get("fast").get(i));
                Map<String, Object> sdk = fieldsOf(got.get("sdk").get(i));
                for (String key : sdk.keySet()) {
                    equal(sdk.get(key), fast.get(key),
                        id + ": " + key + " sent by the fast encoder (against the SDK's)");
                }
                ServiceBusReceivedMessage m = got.get("fast").get(i);
                equal((String) row.get("body_b64"), (String) fast.get("body"), id + ": body (base64)");
                equal("DATA", (String) fast.get("bodyType"), id + ": body type");
                for (String field : new String[] {"subject", "content_type", "correlation_id", "to", "reply_to",
                    "partition_key", "session_id"}) {
                    equal(row.get(field), fast.get(field), id + ": " + field);
                }
                equal(null, fast.get("reply_to_session_id"), id + ": reply_to_session_id");
                Map<String, List<String>> props = (Map<String, List<String>>) row.get("properties");
                equal(new HashSet<>(props.keySet()), new HashSet<>(m.getApplicationProperties().keySet()),
                    id + ": application property names");
                for (Map.Entry<String, List<String>> e : props.entrySet()) {
                    String amqpType = e.getValue().get(0);
                    String text = e.getValue().get(1);
                    Object v = m.getApplicationProperties().get(e.getKey());
                    String what = id + ": application property " + e.getKey() + " (" + amqpType + ")";
                    if (text == null) {
                        equal(null, v, what);
                        continue;
                    }
                    equal(JAVA_TYPES.get(amqpType), typeName(v), what + ": its Java type");
                    if (!amqpType.equals("decimal128")) {
                        equal(text, canon(v), what + ": its value");
                    }
                    properties++;
                }
                described.put(id, fast);
            }
        }
        return String.format("%d messages (%d application property values) sent by the fast encoder: every field, "
            + "each property's value and Java type as the row gave them, and the same as the SDK encoder's",
            described.size(), properties);
    }
}
