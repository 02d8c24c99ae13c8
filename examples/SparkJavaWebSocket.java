// The spec's own Java client style, with the Java-WebSocket library (Maven org.java-websocket:Java-WebSocket);
// it accepts the http:// URI the spec uses. JSON is built by hand here to need no other library.
//   javac -cp Java-WebSocket.jar:slf4j-api.jar SparkJavaWebSocket.java
//   SPARK_SERVER=http://127.0.0.1:9990 java -cp .:Java-WebSocket.jar:slf4j-api.jar SparkJavaWebSocket
import java.net.URI;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.java_websocket.client.WebSocketClient;
import org.java_websocket.drafts.Draft_6455;
import org.java_websocket.handshake.ServerHandshake;

public class SparkJavaWebSocket {
    public static void main(String[] args) throws Exception {
        CountDownLatch done = new CountDownLatch(1);
        String server = System.getenv().getOrDefault("SPARK_SERVER", "http://127.0.0.1:9990");
        WebSocketClient client = new WebSocketClient(new URI(server + "/turing/v3/gpt"), new Draft_6455()) {
            @Override public void onOpen(ServerHandshake handshake) { }
            @Override public void onMessage(String message) {
                System.out.println(message);
                String compact = message.replace(" ", "");
                if (!compact.contains("\"code\":0") || compact.contains("\"status\":2")) done.countDown();
            }
            @Override public void onClose(int code, String reason, boolean remote) { done.countDown(); }
            @Override public void onError(Exception ex) { ex.printStackTrace(); done.countDown(); }
        };
        if (!client.connectBlocking(10000, TimeUnit.MILLISECONDS)) throw new IllegalStateException("not connected");
        client.send("{\"header\":{\"traceId\":\"spark-demo-test\"},"
                + "\"chat\":{\"max_tokens\":24,\"temperature\":0.1,\"top_k\":1},"
                + "\"payload\":{\"message\":{\"text\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}]}}}");
        done.await(120, TimeUnit.SECONDS);
        client.close();
        System.out.println("end");
    }
}
