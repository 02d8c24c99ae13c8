// iFlytek's public Spark form (/v3.5/chat) with the JDK's own java.net.http.WebSocket (Java 11+, no
// dependencies), the URL signed with HMAC-SHA256 as iFlytek's SDKs sign it. Two turns, the second carrying
// the first; with the argument "function", one question offered a function, whose call is printed.
//   javac SparkPublicJdk.java && SPARK_SERVER=http://127.0.0.1:9990 java SparkPublicJdk
// With --spark-auth KEY:SECRET on the server, set SPARK_API_KEY and SPARK_API_SECRET to that pair (and
// SPARK_APP_ID to an allowed app_id); without it the signature is not checked.
import java.net.URI;
import java.net.URLEncoder;
import java.net.http.HttpClient;
import java.net.http.WebSocket;
import java.nio.charset.StandardCharsets;
import java.text.SimpleDateFormat;
import java.util.Base64;
import java.util.Date;
import java.util.Locale;
import java.util.TimeZone;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;

public class SparkPublicJdk {
    static final String APP_ID = System.getenv().getOrDefault("SPARK_APP_ID", "demo-app");
    static final String API_KEY = System.getenv().getOrDefault("SPARK_API_KEY", "demo-key");
    static final String API_SECRET = System.getenv().getOrDefault("SPARK_API_SECRET", "demo-secret");

    // iFlytek's signature: HMAC-SHA256 over "host: H\ndate: D\nGET /path HTTP/1.1", base64, wrapped in an
    // authorization string that is itself base64'd into the query with the date and host.
    static String signedUrl(URI base) throws Exception {
        SimpleDateFormat format = new SimpleDateFormat("EEE, dd MMM yyyy HH:mm:ss z", Locale.US);
        format.setTimeZone(TimeZone.getTimeZone("GMT"));
        String date = format.format(new Date());
        String host = base.getAuthority();
        String origin = "host: " + host + "\ndate: " + date + "\nGET " + base.getPath() + " HTTP/1.1";
        Mac mac = Mac.getInstance("HmacSHA256");
        mac.init(new SecretKeySpec(API_SECRET.getBytes(StandardCharsets.UTF_8), "HmacSHA256"));
        String signature = Base64.getEncoder().encodeToString(mac.doFinal(origin.getBytes(StandardCharsets.UTF_8)));
        String authorization = String.format("api_key=\"%s\", algorithm=\"%s\", headers=\"%s\", signature=\"%s\"",
                API_KEY, "hmac-sha256", "host date request-line", signature);
        String encoded = Base64.getEncoder().encodeToString(authorization.getBytes(StandardCharsets.UTF_8));
        return base + "?authorization=" + URLEncoder.encode(encoded, StandardCharsets.UTF_8)
                + "&date=" + URLEncoder.encode(date, StandardCharsets.UTF_8)
                + "&host=" + URLEncoder.encode(host, StandardCharsets.UTF_8);
    }

    static String quote(String text) {
        return "\"" + text.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n") + "\"";
    }

    static String unescape(String json) {  // a JSON string's escapes, as far as answers use them
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < json.length(); i++) {
            char c = json.charAt(i);
            if (c != '\\' || i + 1 == json.length()) { out.append(c); continue; }
            char e = json.charAt(++i);
            switch (e) {
                case 'n': out.append('\n'); break;
                case 't': out.append('\t'); break;
                case 'r': out.append('\r'); break;
                case 'u': out.append((char) Integer.parseInt(json.substring(i + 1, i + 5), 16)); i += 4; break;
                default: out.append(e);
            }
        }
        return out.toString();
    }

    static final Pattern CONTENT = Pattern.compile("\"content\"\\s*:\\s*\"((?:[^\"\\\\]|\\\\.)*)\"");
    static final Pattern FUNCTION_CALL = Pattern.compile("\"function_call\"\\s*:\\s*(\\{[^}]*\\})");

    // One question on one connection: prints each frame, returns the answer's text (or the call).
    static String ask(URI base, String dialogue, String functions) throws Exception {
        CompletableFuture<String> done = new CompletableFuture<>();
        StringBuilder frame = new StringBuilder();
        StringBuilder answer = new StringBuilder();
        WebSocket.Listener listener = new WebSocket.Listener() {
            @Override
            public CompletionStage<?> onText(WebSocket ws, CharSequence data, boolean last) {
                frame.append(data);
                if (last) {
                    String message = frame.toString();
                    frame.setLength(0);
                    System.out.println(message);
                    String compact = message.replace(" ", "");  // a JSON library would do better; none is needed
                    Matcher content = CONTENT.matcher(message);
                    if (content.find()) answer.append(unescape(content.group(1)));
                    Matcher call = FUNCTION_CALL.matcher(message);
                    if (call.find()) answer.append(call.group(1));
                    if (!compact.contains("\"code\":0")) done.completeExceptionally(new IllegalStateException(message));
                    else if (compact.contains("\"status\":2")) done.complete(answer.toString());
                }
                ws.request(1);
                return null;
            }

            @Override
            public CompletionStage<?> onClose(WebSocket ws, int status, String reason) {
                done.completeExceptionally(new IllegalStateException("closed before the answer: " + reason));
                return null;
            }

            @Override
            public void onError(WebSocket ws, Throwable error) {
                done.completeExceptionally(error);
            }
        };
        WebSocket ws = HttpClient.newHttpClient().newWebSocketBuilder()
                .buildAsync(URI.create(signedUrl(base)), listener).get(10, TimeUnit.SECONDS);
        String request = "{\"header\":{\"app_id\":" + quote(APP_ID) + ",\"uid\":\"java-demo\"},"
                + "\"parameter\":{\"chat\":{\"domain\":\"generalv3.5\",\"temperature\":0.5,\"max_tokens\":32,\"top_k\":1}},"
                + "\"payload\":{\"message\":{\"text\":[" + dialogue + "]}" + functions + "}}";
        ws.sendText(request, true);
        String result = done.get(120, TimeUnit.SECONDS);
        ws.sendClose(WebSocket.NORMAL_CLOSURE, "bye");
        return result;
    }

    static String turn(String role, String content) {
        return "{\"role\":\"" + role + "\",\"content\":" + quote(content) + "}";
    }

    public static void main(String[] args) throws Exception {
        String server = System.getenv().getOrDefault("SPARK_SERVER", "http://127.0.0.1:9990");
        URI base = URI.create(server.replaceFirst("^http", "ws") + "/v3.5/chat");
        if (args.length > 0 && args[0].equals("function")) {
            String functions = ",\"functions\":{\"text\":[{\"name\":\"get_weather\",\"description\":\"the weather in a city\","
                    + "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}]}";
            System.out.println("function_call: " + ask(base, turn("user", "What is the weather in Hefei?"), functions));
            return;
        }
        String system = turn("system", "You are a helpful assistant.");
        String first = turn("user", "What is the capital of France?");
        String answer = ask(base, system + "," + first, "");
        System.out.println("answer 1: " + answer);
        String second = ask(base, system + "," + first + "," + turn("assistant", answer) + ","
                + turn("user", "And of Italy?"), "");
        System.out.println("answer 2: " + second);
    }
}
