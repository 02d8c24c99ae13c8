// A Spark WebSocket conversation with the JDK's own java.net.http.WebSocket (Java 11+, no dependencies).
// Note the URI scheme: the JDK client takes ws:// (or wss://) only; the spec's example passes an http://
// URI, which only the Java-WebSocket library accepts (SparkJavaWebSocket.java).
//   javac SparkJdk.java && SPARK_SERVER=http://127.0.0.1:9990 java SparkJdk
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.WebSocket;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.TimeUnit;

public class SparkJdk {
    public static void main(String[] args) throws Exception {
        String server = System.getenv().getOrDefault("SPARK_SERVER", "http://127.0.0.1:9990");
        URI uri = URI.create(server.replaceFirst("^http", "ws") + "/turing/v3/gpt");
        CompletableFuture<Integer> done = new CompletableFuture<>();
        StringBuilder frame = new StringBuilder();
        WebSocket.Listener listener = new WebSocket.Listener() {
            @Override
            public CompletionStage<?> onText(WebSocket ws, CharSequence data, boolean last) {
                frame.append(data);
                if (last) {
                    String message = frame.toString();
                    frame.setLength(0);
                    System.out.println(message);
                    String compact = message.replace(" ", "");  // a JSON library would do better; none is needed
                    if (!compact.contains("\"code\":0")) done.complete(1);        // an error frame
                    else if (compact.contains("\"status\":2")) done.complete(0);  // the last frame
                }
                ws.request(1);
                return null;
            }

            @Override
            public CompletionStage<?> onClose(WebSocket ws, int status, String reason) {
                done.complete(0);
                return null;
            }

            @Override
            public void onError(WebSocket ws, Throwable error) {
                done.completeExceptionally(error);
            }
        };
        WebSocket ws = HttpClient.newHttpClient().newWebSocketBuilder().buildAsync(uri, listener).get(10, TimeUnit.SECONDS);
        String request = "{\"header\":{\"traceId\":\"spark-demo-test\"},"
                + "\"chat\":{\"max_tokens\":24,\"temperature\":0.1,\"top_k\":1},"
                + "\"payload\":{\"message\":{\"text\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}]}}}";
        ws.sendText(request, true);
        int code = done.get(120, TimeUnit.SECONDS);
        ws.sendClose(WebSocket.NORMAL_CLOSURE, "bye");
        System.out.println("end");
        System.exit(code);
    }
}
