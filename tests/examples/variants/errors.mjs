// The pages' documented errors through the JavaScript SDK: one line per case, "<class> <status> <code>".
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: "https://api.bricksum.com/v1",
  apiKey: process.env.KILN_API_KEY,
  maxRetries: 0,
});
const cases = {
  model_not_found: () =>
    client.completions.create({ model: "not-a-model", prompt: "The capital of France is", max_tokens: 32 }),
  empty_array: () => client.chat.completions.create({ model: "qwen3-32b", messages: [], max_tokens: 800 }),
  unsupported_parameter: () =>
    client.chat.completions.create({ model: "gpt-oss-120b", messages: [{ role: "user", content: "Hello!" }], ignore_eos: true }),
  invalid_api_key: () =>
    new OpenAI({ baseURL: client.baseURL, apiKey: "sk-kiln-wrong", maxRetries: 0 }).models.list(),
};
for (const [name, call] of Object.entries(cases)) {
  try {
    await call();
    console.log(name, "no error");
  } catch (error) {
    const classes = ["BadRequestError", "AuthenticationError", "PermissionDeniedError", "NotFoundError",
      "RateLimitError", "InternalServerError"];
    const cls = classes.find((c) => error instanceof OpenAI[c]) ?? error.constructor.name;
    console.log(name, cls, error.status, error.code);
  }
}
